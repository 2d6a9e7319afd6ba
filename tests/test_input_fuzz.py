"""A fuzz of the whole input surface: 300 seeded mutations of the shipped pipelines
and of the data files they read (tests/fuzz_cases.py), each through `raydp-train validate`
in this process. Each must end with exit 0, or exit 2/3 with an `error:` line (or validate's
budget refusal), never a traceback or a hang (10 s). A sample also goes through `run`: a
refused one reserves nothing and keeps no run directory. The long mode (3,000 cases):
benchmarks/input_fuzz.py."""

import pytest
from fuzz_cases import as_json, make_case, run_training, run_validate, summary

CASES, SEED = 300, 0
SAMPLE = 3  # of each kind through `run`: each accepted one is a Ray Train run
pytestmark = pytest.mark.slow  # about half a minute: in make test, not in make test-fast


def test_no_mutated_input_ends_in_a_traceback_or_a_hang(tmp_path):
    results = []
    for number in range(CASES):
        case = make_case(number, SEED, tmp_path / f"case{number}")
        results.append((case, run_validate(case)))
    report = summary(results)
    assert not report["broken"], as_json(report["broken"][:5])
    # The cases reach past the schema: some are valid, some refused by the budget's check.
    assert report["exit_codes"].get("0", 0) > 10 and report["exit_codes"].get("2", 0) > 200


@pytest.mark.long
def test_a_sample_runs_or_is_refused_before_anything_is_spent(ray_session, tmp_path):
    """`run` (one epoch) of the first 3 cases validate accepts and the first 3 it refuses:
    what validate lets through must train or stop cleanly; what it refuses, run refuses
    too, in one line, before any budget is reserved or any run directory is made."""
    accepted, refused = [], []
    for number in range(CASES):
        case = make_case(number, SEED, tmp_path / f"case{number}")
        code = run_validate(case).code
        if code == 0 and len(accepted) < SAMPLE:
            accepted.append(case)
        elif code == 2 and len(refused) < SAMPLE:
            refused.append(case)
        if len(accepted) == len(refused) == SAMPLE:
            break
    results = [(case, run_training(case)) for case in accepted + refused]
    report = summary(results)
    assert len(results) == 2 * SAMPLE
    assert not report["broken"], as_json(report["broken"][:5])
    assert sum(outcome.code == 2 for _, outcome in results) >= SAMPLE, report["exit_codes"]
