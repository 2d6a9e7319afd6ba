"""The central accountant without Ray: its decisions, its ledger and its replay.

Oracle: dp-accounting called directly on the same events.
"""

import math
from pathlib import Path

import dp_accounting
import numpy as np
import pyarrow as pa
import pytest
from dp_accounting import pld, rdp

from raydp_train.accounting.random_stopping import (
    draw_trial_count,
    gamma_for_mean,
    trial_count_mean,
)
from raydp_train.budget import exclusive_files
from raydp_train.budget.accountant import BudgetAccountant
from raydp_train.budget.ledger import LedgerCorruptError, LedgerError
from raydp_train.budget.terms import BudgetError, BudgetTerms, Spend

ACCOUNTANTS = {"rdp": rdp.RdpAccountant, "pld": pld.PLDAccountant}


def _direct_epsilon(events, delta, accountant):
    ledger = ACCOUNTANTS[accountant]()
    ledger.compose(dp_accounting.ComposedDpEvent(events))
    return ledger.get_epsilon(delta)


def _dpsgd(q, sigma, steps):
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)


def _accountant(tmp_path, epsilon=10.0, accountant="rdp", name="b"):
    return BudgetAccountant(str(tmp_path), BudgetTerms(name, epsilon, 1e-5, accountant))


HETEROGENEOUS = [(0.01, 1.1, 300), (0.05, 0.9, 40), (0.02, 2.0, 500), (0.01, 1.1, 100)]


@pytest.mark.thorough
@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_budget_epsilon_equals_dp_accounting_composition(tmp_path, accountant):
    budget = _accountant(tmp_path, epsilon=50.0, accountant=accountant)
    for i, (q, sigma, steps) in enumerate(HETEROGENEOUS):
        assert budget.reserve(f"r{i}", f"trial{i}", Spend(q, sigma, steps)).granted
    expected = _direct_epsilon([_dpsgd(*e) for e in HETEROGENEOUS], 1e-5, accountant)
    assert budget.status()["epsilon_counted"] == pytest.approx(expected, rel=1e-9)
    # A restarted accountant recomposes the events from the ledger: same epsilon.
    assert _accountant(tmp_path, 50.0, accountant).book.recomposed_epsilon() == pytest.approx(
        expected, rel=1e-6)


def test_refusal_says_what_remains_and_what_was_asked(tmp_path):
    one = _direct_epsilon([_dpsgd(0.02, 1.0, 200)], 1e-5, "rdp")
    budget = _accountant(tmp_path, epsilon=float(one * 1.2))
    assert budget.reserve("a", "trial-a", Spend(0.02, 1.0, 200)).granted
    refused = budget.reserve("b", "trial-b", Spend(0.02, 1.0, 200))
    assert not refused.granted and refused.reservation == ""
    assert "budget exhausted" in refused.reason and "trial-b" in refused.reason
    assert "200 steps at q=0.02, sigma=1" in refused.reason
    assert f"{one * 0.2:.4g} of" in refused.reason  # what remains
    assert refused.epsilon_after > budget.book.terms.epsilon
    assert budget.status()["epsilon_counted"] == pytest.approx(one, rel=1e-12)


def test_settle_returns_unused_steps_and_unsettled_reservations_stay_counted(tmp_path):
    budget = _accountant(tmp_path)
    crashed = budget.reserve("r1", "crashed", Spend(0.02, 1.0, 100))
    finished = budget.reserve("r2", "finished", Spend(0.05, 1.5, 100))
    assert crashed.granted and finished.granted
    assert budget.settle("s1", finished.reservation, steps_done=30) == 70
    assert budget.settle("s1", finished.reservation, steps_done=30) == 70  # retried: same answer
    status = budget.status()
    assert status["owners"]["crashed"]["steps_reserved"] == 100  # never settled: counted in full
    assert status["owners"]["finished"]["steps_spent"] == 30
    assert (status["steps_spent"], status["steps_reserved"]) == (30, 100)
    expected = _direct_epsilon([_dpsgd(0.02, 1.0, 100), _dpsgd(0.05, 1.5, 30)], 1e-5, "rdp")
    assert status["epsilon_counted"] == pytest.approx(expected, rel=1e-9)
    with pytest.raises(BudgetError, match="already settled"):
        budget.settle("s2", finished.reservation, steps_done=30)
    with pytest.raises(BudgetError, match="do not fit"):
        budget.settle("s3", crashed.reservation, steps_done=101)


def test_retried_reserve_is_answered_not_granted_twice(tmp_path):
    budget = _accountant(tmp_path)
    first = budget.reserve("same-id", "t", Spend(0.02, 1.0, 100))
    again = budget.reserve("same-id", "t", Spend(0.02, 1.0, 100))
    assert again == first
    assert budget.status()["steps_reserved"] == 100
    assert len(budget.ledger.rows()) == 2  # the open row and one reservation


@pytest.mark.thorough
def test_restart_rebuilds_identical_status_from_the_ledger(tmp_path):
    budget = _accountant(tmp_path, accountant="pld")
    kept = budget.reserve("r1", "a", Spend(0.02, 1.0, 100))
    budget.reserve("r2", "b", Spend(0.01, 0.8, 50, release_noise_multiplier=5.0, releases=2))
    budget.settle("s1", kept.reservation, steps_done=60)
    before = budget.status()
    assert _accountant(tmp_path, accountant="pld").status() == before


def test_ledger_rows_carry_event_kind_time_and_running_epsilon(tmp_path):
    budget = _accountant(tmp_path)
    granted = budget.reserve("r1", "trial", Spend(0.02, 1.0, 100))
    budget.settle("s1", granted.reservation, steps_done=100)
    rows = budget.ledger.rows()
    assert [r["kind"] for r in rows] == ["open", "reserve", "settle"]
    assert rows[1]["owner"] == "trial" and rows[1]["steps"] == 100
    assert rows[1]["sampling_rate"] == 0.02 and rows[1]["noise_multiplier"] == 1.0
    assert rows[1]["running_epsilon"] == pytest.approx(granted.epsilon_after)
    assert rows[2]["running_epsilon"] == rows[1]["running_epsilon"]  # nothing given back
    assert all(r["timestamp"] > 0 and r["budget"] == "b" for r in rows)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "delete"])
def test_damaged_ledger_is_reported_never_dropped(tmp_path, damage):
    budget = _accountant(tmp_path)
    for i in range(3):
        budget.reserve(f"r{i}", "t", Spend(0.02, 1.0, 10))
    fragment = sorted((Path(tmp_path) / "b").glob("*.parquet"))[2]
    if damage == "truncate":
        fragment.write_bytes(fragment.read_bytes()[:40])
    elif damage == "garbage":
        fragment.write_bytes(b"not parquet at all")
    else:
        fragment.unlink()
    reopened = _accountant(tmp_path)
    expected = fragment.name if damage != "delete" else "fragment number 2"
    with pytest.raises(LedgerCorruptError, match=expected):
        reopened.status()
    with pytest.raises(LedgerCorruptError):
        reopened.reserve("r9", "t", Spend(0.02, 1.0, 10))


def test_budget_terms_are_fixed_at_creation(tmp_path):
    _accountant(tmp_path, epsilon=5.0)
    reopened = _accountant(tmp_path, epsilon=8.0)  # the ledger's terms win
    assert reopened.book.terms.epsilon == 5.0
    with pytest.raises(BudgetError, match="created with epsilon=5"):
        reopened.check_terms(BudgetTerms("b", 8.0, 1e-5, "rdp"), str(tmp_path))
    with pytest.raises(BudgetError, match="created with .*delta=1e-05"):
        reopened.check_terms(BudgetTerms("b", 5.0, 1e-6, "rdp"), str(tmp_path))


def test_failed_ledger_write_grants_nothing(tmp_path, monkeypatch):
    budget = _accountant(tmp_path)
    before = budget.status()

    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")  # writing beneath a file fails like a full or read-only disk
    monkeypatch.setattr(budget.ledger, "directory", str(blocker / "b"))
    with pytest.raises(LedgerError, match="cannot write ledger fragment"):
        budget.reserve("r1", "t", Spend(0.02, 1.0, 10))
    assert budget.status() == before


def test_full_disk_refuses_the_reservation(tmp_path, monkeypatch):
    """ENOSPC from the filesystem while the fragment is written: refused, nothing counted."""
    budget = _accountant(tmp_path)
    before, rows_before = budget.status(), budget.ledger.rows()
    real_open = open

    def disk_full_on_write(path, mode="r", *args, **kwargs):
        stream = real_open(path, mode, *args, **kwargs)
        if "x" in mode:  # the fragment's temporary file: it exists, the write fails
            stream.write = lambda data: (_ for _ in ()).throw(
                OSError(28, "No space left on device", path))
        return stream

    monkeypatch.setattr(exclusive_files, "open", disk_full_on_write, raising=False)
    with pytest.raises(LedgerError, match="No space left on device"):
        budget.reserve("r1", "t", Spend(0.02, 1.0, 10))
    assert budget.status() == before
    monkeypatch.undo()
    assert budget.ledger.rows() == rows_before  # no fragment, not even a partial one
    assert not list((tmp_path / "b").glob(".*.tmp"))  # nor a temporary file left behind
    assert budget.reserve("r1", "t", Spend(0.02, 1.0, 10)).granted  # works once there is space


def test_reset_is_a_ledger_row_and_keeps_the_history(tmp_path):
    budget = _accountant(tmp_path)
    finished = budget.reserve("r1", "finished", Spend(0.02, 1.0, 100))
    budget.settle("s1", finished.reservation, steps_done=100)
    running = budget.reserve("r2", "running", Spend(0.05, 1.5, 40))
    rows_before = budget.ledger.rows()

    status = budget.reset("x1", "reset by tester: new data release")
    # Settled spending stops counting; the open reservation of a live run still counts in full.
    assert status["resets"] == 1
    assert status["epsilon_counted"] == pytest.approx(
        _direct_epsilon([_dpsgd(0.05, 1.5, 40)], 1e-5, "rdp"), rel=1e-9)
    assert set(status["owners"]) == {"running"}
    rows = budget.ledger.rows()
    assert rows[: len(rows_before)] == rows_before  # history never rewritten
    assert rows[-1]["kind"] == "reset" and "new data release" in rows[-1]["owner"]
    assert budget.reset("x1", "retried") == status and len(budget.ledger.rows()) == len(rows)
    budget.settle("s2", running.reservation, steps_done=10)  # still settles after the reset
    assert _accountant(tmp_path).status() == budget.status()  # a restart replays the reset


def test_status_shows_the_epsilon_spent_across_resets(tmp_path):
    """Each reset period's own epsilon (what it settled) and their sum, stated as basic
    composition; a reservation open across a reset counts in the period it settles in."""
    from raydp_train.reports.budget import status_text

    budget = _accountant(tmp_path)
    first = budget.reserve("r1", "first", Spend(0.02, 1.0, 100))
    budget.settle("s1", first.reservation, steps_done=100)
    carried = budget.reserve("r2", "carried", Spend(0.05, 1.5, 40))
    budget.reset("x1", "new quarter")
    budget.settle("s2", carried.reservation, steps_done=40)
    budget.reset("x2", "new year")
    last = budget.reserve("r3", "last", Spend(0.01, 1.1, 300))
    budget.settle("s3", last.reservation, steps_done=300)

    periods = [_direct_epsilon([_dpsgd(*spend)], 1e-5, "rdp")
               for spend in ((0.02, 1.0, 100), (0.05, 1.5, 40), (0.01, 1.1, 300))]
    status = budget.status()
    assert status["epsilon_before_resets"] == pytest.approx(periods[:2], rel=1e-9)
    assert status["epsilon_counted"] == pytest.approx(periods[2], rel=1e-9)
    assert status["epsilon_across_resets"] == pytest.approx(sum(periods), rel=1e-9)
    assert _accountant(tmp_path).status() == status  # replayed from the ledger alike
    line = status_text(status).splitlines()[2]
    assert f"{periods[0]:.4f}, {periods[1]:.4f} before each reset" in line
    assert f"{periods[2]:.4f} since the last" in line
    assert f"across resets: epsilon {sum(periods):.4f} with delta 3e-05 by basic composition" \
        in line


def test_bad_reservations_are_refused_with_reasons(tmp_path):
    budget = _accountant(tmp_path)
    with pytest.raises(BudgetError, match="sampling_rate must be in"):
        budget.reserve("r", "t", Spend(1.5, 1.0, 10))
    with pytest.raises(BudgetError, match="asks for nothing"):
        budget.reserve("r", "t", Spend(0.1, 1.0, 0))


def test_random_stopping_epsilon_equals_repeat_and_select(tmp_path):
    budget = _accountant(tmp_path, epsilon=100.0)
    spend = Spend(0.02, 1.2, 200, release_noise_multiplier=10.0, releases=5,
                  mean_trials=8.0, shape=1.0)
    assert budget.reserve("r", "sweep", spend).granted
    trial = dp_accounting.ComposedDpEvent([
        _dpsgd(0.02, 1.2, 200),
        dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(10.0), 5)])
    expected = _direct_epsilon(
        [dp_accounting.dp_event.RepeatAndSelectDpEvent(trial, 8.0, 1.0)], 1e-5, "rdp")
    assert budget.status()["epsilon_counted"] == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("shape", [0.0, 0.5, 1.0, 3.0, math.inf])
def test_trial_count_distribution_has_the_asked_mean(shape):
    mean = 6.0
    if not math.isinf(shape):
        assert trial_count_mean(gamma_for_mean(mean, shape), shape) == pytest.approx(mean)
    rng = np.random.default_rng(0)
    draws = np.array([draw_trial_count(mean, shape, rng) for _ in range(20000)])
    assert abs(draws.mean() - mean) < 4 * draws.std() / math.sqrt(len(draws))
    assert math.isinf(shape) or draws.min() >= 1  # only Poisson may run no trial


def test_ledger_rows_use_the_parquet_schema(tmp_path):
    _accountant(tmp_path)
    (fragment,) = (Path(tmp_path) / "b").glob("*.parquet")
    table = pa.parquet.read_table(fragment)
    assert table.num_rows == 1 and table.column("kind")[0].as_py() == "open"


def test_the_ledger_records_the_mechanism_and_old_ledgers_replay(tmp_path):
    from raydp_train.budget.book import replay
    from raydp_train.budget.ledger_reading import ledger_rows

    budget = _accountant(tmp_path, epsilon=100.0)
    assert budget.reserve("a", "lsg-run", Spend(0.02, 1.2, 200, mechanism="lsg")).granted
    sweep = Spend(0.02, 1.2, 200, mean_trials=8.0, shape=1.0)
    assert budget.reserve("b", "sweep", sweep).granted
    rows = ledger_rows("b", str(tmp_path))
    assert [r["mechanism"] for r in rows[1:]] == ["lsg", "dpsgd"]
    # LSG's steps are DP-SGD's event: the same epsilon as the direct composition.
    trial = _dpsgd(0.02, 1.2, 200)
    expected = _direct_epsilon(
        [trial, dp_accounting.dp_event.RepeatAndSelectDpEvent(trial, 8.0, 1.0)], 1e-5, "rdp")
    assert budget.status()["epsilon_counted"] == pytest.approx(expected, rel=1e-9)
    # Ledgers written before mechanisms were named called a random-stopping sweep
    # "random_stopping": they replay to the epsilon they recorded.
    rows[2]["mechanism"] = "random_stopping"
    assert replay(rows).recomposed_epsilon() == pytest.approx(expected, rel=1e-9)
    with pytest.raises(BudgetError, match="mechanism must be one of dpsgd, lora, lsg, got none"):
        budget.reserve("c", "reference", Spend(0.02, 1.2, 200, mechanism="none"))


def test_a_sweeps_epsilon_counts_its_own_trials_and_no_other_sweeps(tmp_path):
    """Sweep `s` owns `s/<trial>`; a sweep started the same second is `s-1`: not its own."""
    budget, spend = _accountant(tmp_path), Spend(0.02, 1.0, 10)
    for owner in ("s/t1", "s/t2", "s-1/t1"):
        assert budget.reserve(owner, owner, spend).granted
    alone = _accountant(tmp_path / "alone", name="alone")
    for owner in ("s/t1", "s/t2"):
        alone.reserve(owner, owner, spend)
    assert budget.epsilon_of("s") == pytest.approx(alone.epsilon_of("s"), rel=1e-12)
    assert budget.epsilon_of("s") < budget.status()["epsilon_counted"]


def test_a_settle_retried_after_a_reset_is_answered_as_before(tmp_path):
    """Ray may deliver a settle twice; a reset between the two removed the settled
    reservation: the retry is answered from the first, without an error."""
    budget = _accountant(tmp_path)
    granted = budget.reserve("r1", "run", Spend(0.02, 1.0, 100))
    budget.settle("s1", granted.reservation, 40)
    budget.reset("reset-1", "new quarter")
    budget.settle("s1", granted.reservation, 40)
    assert budget.status()["steps_reserved"] == 0
