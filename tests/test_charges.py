"""The write-ahead record of steps spent: durable, additive, and read back by a new process;
and the run's account, which asks the global budget before recording."""

import pytest

from raydp_train.plan import PrivacyPlan
from raydp_train.privacy.budget import BudgetTerms
from raydp_train.privacy.budget_accountant import BudgetAccountant
from raydp_train.train.charges import (
    Charged,
    ChargeLedger,
    ChargeRefused,
    MemoryCharges,
    RunAccount,
    planned_charges,
)


def test_charges_add_up_and_survive_a_new_ledger(tmp_path):
    first = ChargeLedger(str(tmp_path))
    assert first.charge(Charged(10, 1)) == (10, 1)
    assert first.charge(Charged(13, 1)) == (23, 2)
    # A restarted worker group opens the same run directory: nothing recorded is lost,
    # and its new charge counts once.
    restarted = ChargeLedger(str(tmp_path))
    assert restarted.total() == (23, 2)
    assert restarted.charge(Charged(13)) == (36, 2)
    assert ChargeLedger(str(tmp_path)).total() == (36, 2)
    assert len(list((tmp_path / "charges").glob("*.json"))) == 3


def test_an_unfinished_write_is_not_counted(tmp_path):
    ledger = ChargeLedger(str(tmp_path))
    ledger.charge(Charged(4))
    (tmp_path / "charges" / ".partial.json.tmp").write_text('{"steps": 99}')
    assert ChargeLedger(str(tmp_path)).total() == (4, 0)


class _InProcessBudget:
    """The accountant called directly, as BudgetClient calls the actor."""

    def __init__(self, accountant):
        self.accountant, self.calls = accountant, 0

    def reserve(self, owner, spend):
        self.calls += 1
        return self.accountant.reserve(f"request-{self.calls}", owner, spend)

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
    with pytest.raises(ChargeRefused, match="budget exhausted"):
        account.charge(Charged(20, 1))
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
