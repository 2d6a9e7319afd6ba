"""The write-ahead record of steps spent: durable, additive, and read back by a new process;
and the run's account, which asks the global budget before recording."""

import pytest

from raydp_train.budget.accountant import BudgetAccountant
from raydp_train.budget.terms import BudgetTerms
from raydp_train.train.charges import (
    Charged,
    ChargeRefused,
    MemoryCharges,
    RunAccount,
    RunCharges,
    planned_charges,
)
from raydp_train.train.plan import PrivacyPlan


def _run_epoch(ledger, epoch: int, first_step: int, steps: int, ran: int | None = None,
               release: bool = False, request: str = "") -> None:
    """Charge an epoch of `steps` steps (and a metric release), then mark the first `ran`."""
    ledger.charge(Charged(steps, int(release)), request, epoch, first_step)
    for step in range(first_step, first_step + (steps if ran is None else ran)):
        ledger.mark_step(step)
    if release and ran is None:
        ledger.mark_release(epoch)


def test_charges_add_up_and_a_new_attempt_counts_what_the_dead_one_released(tmp_path):
    first = RunCharges(str(tmp_path))
    assert first.charge(Charged(10, 1), "r1", 1, 0) == (10, 1)
    for step in range(10):
        first.mark_step(step)
    first.mark_release(1)
    assert first.charge(Charged(13, 1), "r2", 2, 10) == (23, 2)  # write-ahead: in full
    for step in range(10, 15):  # killed after releasing 5 of its 13 steps, and no metric
        first.mark_step(step)
    # The restarted worker group is a new attempt: the dead one counts what it released.
    restarted = RunCharges(str(tmp_path))
    assert restarted.total() == (15, 1)
    assert restarted.dead_closings() == [("r1", 10, 1), ("r2", 5, 0)]
    assert restarted.charge(Charged(13, 1), "r3", 2, 10) == (28, 2)  # epoch 2 runs again
    assert len(list((tmp_path / "charges").glob("*.json"))) == 3
    # A later attempt reads both logs; the restarted one released nothing yet.
    assert RunCharges(str(tmp_path)).total() == (15, 1)


def test_a_charge_without_its_release_log_counts_in_full(tmp_path):
    """An object store keeps no log, a legacy record names no attempt, a log can be lost or
    torn: never count less than may have been released."""
    first = RunCharges(str(tmp_path))
    _run_epoch(first, 1, 0, 10, ran=3)
    (log,) = (tmp_path / "charges").glob("released-*.log")
    assert RunCharges(str(tmp_path)).total() == (3, 0)
    log.write_text("step 0\nstep 1\nste")
    assert RunCharges(str(tmp_path)).total() == (10, 0)
    log.unlink()
    assert RunCharges(str(tmp_path)).total() == (10, 0)
    (tmp_path / "charges" / "0-legacy.json").write_text('{"steps": 7, "releases": 1}')
    assert RunCharges(str(tmp_path)).total() == (17, 1)


def test_a_withdrawn_charge_never_counts(tmp_path):
    ledger = RunCharges(str(tmp_path))
    _run_epoch(ledger, 1, 0, 10)
    ledger.charge(Charged(10, 1), "refused", 2, 10)
    ledger.withdraw(Charged(10, 1))
    assert ledger.total() == (10, 0)
    assert RunCharges(str(tmp_path)).total() == (10, 0)


def test_an_unfinished_write_is_not_counted(tmp_path):
    ledger = RunCharges(str(tmp_path))
    ledger.charge(Charged(4))
    (tmp_path / "charges" / ".partial.json.tmp").write_text('{"steps": 99}')
    assert ledger.total() == (4, 0)
    assert RunCharges(str(tmp_path)).total() == (0, 0)  # no step of it was released


class _InProcessBudget:
    """The accountant called directly, as BudgetClient calls the actor."""

    def __init__(self, accountant):
        self.accountant, self.calls = accountant, 0

    def reserve(self, owner, spend, request_id=""):
        self.calls += 1
        return self.accountant.reserve(request_id or f"request-{self.calls}", owner, spend)

    def close_requests(self, closings):
        return self.accountant.close_requests(closings)

    def settle(self, decision, steps_done, releases_done=0):
        self.calls += 1
        return self.accountant.settle(f"request-{self.calls}", decision.reservation, steps_done,
                                      releases_done)


def _plan(**changes):
    fields = {"num_examples": 1000, "expected_batch_size": 50, "sampling_rate": 0.05,
              "steps": 100, "noise_multiplier": 1.0, "noise_calibrated": False, "clip_norm": 1.0,
              "delta": 1e-5, "accountant": "rdp", "epochs": 5, "release_noise_multiplier": 3.0}
    return PrivacyPlan(**{**fields, **changes})


def test_run_account_reserves_before_recording_and_stops_when_refused(tmp_path):
    plan = _plan()
    one_epoch = plan.epsilon(20, releases=1)
    accountant = BudgetAccountant(str(tmp_path), BudgetTerms("b", one_epoch * 1.1, 1e-5))
    account = RunAccount(MemoryCharges(), _InProcessBudget(accountant), "run-1", plan)
    assert account.charge(Charged(20, 1)) == (20, 1)
    status = accountant.status()
    assert status["owners"]["run-1"]["steps_reserved"] == 20
    assert status["epsilon_counted"] == pytest.approx(one_epoch, rel=1e-9)
    account.settle(Charged(20, 1))
    assert accountant.status()["owners"]["run-1"]["steps_spent"] == 20
    with pytest.raises(ChargeRefused, match="budget exhausted") as refused:
        account.charge(Charged(20, 1))
    assert str(refused.value).startswith("budget exhausted: 'b' has epsilon")  # said once
    assert account.total() == (20, 1)  # the refused epoch was never recorded


def test_run_account_never_charges_past_its_epsilon_cap(tmp_path):
    """A calibrated run's target: the epoch that would pass it is refused, not recorded, and
    the global budget is not asked."""
    plan = _plan()
    cap = plan.epsilon(40, releases=2)
    accountant = BudgetAccountant(str(tmp_path), BudgetTerms("b", 100.0, 1e-5))
    account = RunAccount(MemoryCharges(), _InProcessBudget(accountant), "run-1", plan,
                         epsilon_cap=cap)
    account.charge(Charged(20, 1))
    account.settle(Charged(20, 1))
    assert account.charge(Charged(20, 1)) == (40, 2)  # exactly at the cap: allowed
    account.settle(Charged(20, 1))
    with pytest.raises(ChargeRefused, match=r"target epsilon reached: 40 steps .* next epoch's 1 "):
        account.charge(Charged(1, 0))
    assert account.total() == (40, 2)
    assert accountant.status()["owners"]["run-1"]["steps_spent"] == 40


def test_a_run_under_a_reservation_made_elsewhere_never_charges_past_it():
    """A random-stopping trial: the sweep reserved its planned steps and releases once; a
    restart that repeats an epoch is refused, not recorded."""
    plan = _plan()  # 5 epochs of 20 steps, one release each
    account = RunAccount(MemoryCharges(), None, "sweep/trial", plan,
                         ceiling=planned_charges(plan))
    assert planned_charges(plan) == (100, 5)
    for _ in range(4):
        account.charge(Charged(20, 1))
    with pytest.raises(ChargeRefused, match="reservation used up: the sweep reserved 100 steps "
                                            "and 5 releases for this trial, and the next epoch "
                                            "would charge 100 and 6"):
        account.charge(Charged(20, 2))  # more releases than reserved
    assert account.charge(Charged(20, 1)) == (100, 5)  # exactly what was reserved
    with pytest.raises(ChargeRefused, match="would charge 101 and 5"):
        account.charge(Charged(1, 0))
    assert account.total() == (100, 5)


def test_a_restart_settles_the_dead_attempts_reservation_with_what_it_released(tmp_path):
    """The budget granted epoch 2 in full; its attempt died after 6 of 20 steps. The new
    attempt's first charge first returns the 14 never released, so the budget counts exactly
    the steps released: 20 + 6 + the rerun's 20."""
    plan = _plan()
    accountant = BudgetAccountant(str(tmp_path / "ledger"), BudgetTerms("b", 100.0, 1e-5))
    budget = _InProcessBudget(accountant)
    dead = RunAccount(RunCharges(str(tmp_path / "run")), budget, "run-1", plan)
    dead.charge(Charged(20, 1), epoch=1, first_step=0)
    for step in range(20):
        dead.releasing_step(step)
    dead.releasing_metric(1)
    dead.settle(Charged(20, 1))
    dead.charge(Charged(20, 1), epoch=2, first_step=20)
    for step in range(20, 26):
        dead.releasing_step(step)
    assert accountant.status()["owners"]["run-1"]["steps_reserved"] == 20

    restarted = RunAccount(RunCharges(str(tmp_path / "run")), budget, "run-1", plan)
    assert restarted.total() == (26, 1)
    assert restarted.charge(Charged(20, 1), epoch=2, first_step=20) == (46, 2)
    owner = accountant.status()["owners"]["run-1"]
    assert (owner["steps_spent"], owner["steps_reserved"]) == (26, 20)
    # Closing again (another restart) changes nothing: each reservation settles once.
    assert accountant.close_requests(restarted.record.dead_closings()) == 0


def test_a_refused_reservation_is_withdrawn_from_the_record(tmp_path):
    plan = _plan()
    accountant = BudgetAccountant(str(tmp_path / "ledger"),
                                  BudgetTerms("b", plan.epsilon(20, releases=1) * 1.1, 1e-5))
    account = RunAccount(RunCharges(str(tmp_path / "run")), _InProcessBudget(accountant),
                         "run-1", plan)
    account.charge(Charged(20, 1), epoch=1)
    with pytest.raises(ChargeRefused, match="budget exhausted"):
        account.charge(Charged(20, 1), epoch=2, first_step=20)
    assert account.total() == (20, 1)
    assert len(list((tmp_path / "run" / "charges").glob("*.json"))) == 1


def test_a_charge_is_on_disk_with_its_name_before_it_is_charged(tmp_path, monkeypatch):
    """Its record and the directory entry naming it are synced (a power cut must not lose a
    charge whose steps the synced release log shows released, nor leave an empty record)."""
    import os

    from raydp_train.budget import exclusive_files

    synced, fsync = [], os.fsync

    def recording(descriptor):
        synced.append(os.readlink(f"/proc/self/fd/{descriptor}"))
        fsync(descriptor)

    monkeypatch.setattr(exclusive_files.os, "fsync", recording)
    ledger = RunCharges(str(tmp_path))
    ledger.charge(Charged(5))
    assert any(path.endswith(".json.tmp") for path in synced), synced  # the record
    assert str(tmp_path / "charges") in synced, synced  # its name
    assert ledger.total() == (5, 0)
