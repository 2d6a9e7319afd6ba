"""A dead attempt's release log settles its reservation only if its lines chain: a
log cut inside a line, with a line removed or edited, or written before the chain, counts as
lost (the reservation stays counted in full); a log cut at a line boundary is outweighed by
the checkpoint the next attempt resumed from."""

import pytest
from test_charges import _InProcessBudget, _plan

from raydp_train.budget.accountant import BudgetAccountant
from raydp_train.budget.terms import BudgetTerms
from raydp_train.train.charges import Charged, RunAccount, RunCharges


def crashed_run(tmp_path, ran: int):
    """Epoch 1 (steps 0-19) settled; epoch 2 (steps 20-39) granted, killed after `ran` steps."""
    accountant = BudgetAccountant(str(tmp_path / "ledger"), BudgetTerms("b", 100.0, 1e-5))
    budget = _InProcessBudget(accountant)
    dead = RunAccount(RunCharges(str(tmp_path / "run")), budget, "run-1", _plan())
    for epoch, first, steps in ((1, 0, 20), (2, 20, ran)):
        dead.charge(Charged(20, 1), epoch=epoch, first_step=first)
        for step in range(first, first + steps):
            dead.releasing_step(step)
        if epoch == 1:
            dead.releasing_metric(1)
            dead.settle(Charged(20, 1))
    (log,) = (tmp_path / "run" / "charges").glob("released-*.log")
    return accountant, budget, log


def restart(tmp_path, budget, resumed_at: int = 20) -> tuple[int, int]:
    """The next attempt resumes at `resumed_at` and charges; (steps spent, reserved) after."""
    restarted = RunAccount(RunCharges(str(tmp_path / "run")), budget, "run-1", _plan())
    restarted.charge(Charged(40 - resumed_at, 1), epoch=2, first_step=resumed_at)
    owner = budget.accountant.status()["owners"]["run-1"]
    return owner["steps_spent"], owner["steps_reserved"]


def test_an_intact_log_settles_what_it_marks(tmp_path):
    _, budget, log = crashed_run(tmp_path, ran=12)
    assert log.read_text().splitlines()[0].split(" ")[:3] == ["step", "0", "1"]
    assert restart(tmp_path, budget) == (20 + 12, 20)


@pytest.mark.parametrize("damage", ["cut inside a line", "a line removed", "a line edited",
                                    "written before the chain"])
def test_a_shortened_or_damaged_log_settles_in_full(tmp_path, damage):
    """The released 12 steps of epoch 2 shown as fewer: the reservation stays counted, 20."""
    _, budget, log = crashed_run(tmp_path, ran=12)
    lines = log.read_text().splitlines(keepends=True)
    changed = {
        "cut inside a line": lines[:-1] + [lines[-1][:-4]],
        "a line removed": lines[:25] + lines[26:],
        "a line edited": lines[:-1] + [lines[-1].replace("step 31", "step 19")],
        "written before the chain": [" ".join(line.split(" ")[:2]) + "\n" for line in lines],
    }[damage]
    log.write_text("".join(changed))
    assert restart(tmp_path, budget) == (20 + 20, 20)


def test_a_log_cut_at_a_line_boundary_is_outweighed_by_the_checkpoint(tmp_path):
    """Epoch 2 ran whole and was checkpointed at step 40, its log then cut to 5 of its 20
    steps: the checkpoint the next attempt resumes from proves 20."""
    _, budget, log = crashed_run(tmp_path, ran=20)
    lines = log.read_text().splitlines(keepends=True)
    log.write_text("".join(lines[:21 + 5]))  # epoch 1's 20 steps and release, 5 of epoch 2
    assert restart(tmp_path, budget, resumed_at=40) == (40, 0)
