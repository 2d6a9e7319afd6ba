"""The pld accountant's smallest noise multiplier: below it PLD's privacy-loss grid needs GiBs
(sigma 1e-3 asked for 38 GiB when a finished run wrote its record). Accounting refuses in one
line, a pipeline is refused by field before anything runs, and a run at a tiny sigma under
rdp reports its pld epsilon as not computed instead of failing after training."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import dp_accounting
import pytest

import raydp_train as rt
from raydp_train.accounting.epsilon import (
    PLD_MIN_NOISE_MULTIPLIER,
    calibrate_noise_multiplier,
    composed_epsilon,
    epsilon_spent,
    smallest_noise_multiplier,
)
from raydp_train.config.errors import PipelineError
from raydp_train.reports.console import print_summary

ROOT = Path(__file__).parents[1]


def _steps(rate: float, sigma: float, steps: int):
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(sigma)), steps)


def _releases(sigma: float, count: int):
    return dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(sigma), count)


def test_pld_below_its_floor_is_refused_in_one_line_while_rdp_accounts():
    with pytest.raises(ValueError, match=r"needs noise multipliers >= 0.3 \(got 0.001\).*rdp"):
        epsilon_spent(0.148, 0.001, 54, 1e-5, "pld")
    oracle = dp_accounting.rdp.RdpAccountant().compose(_steps(0.148, 0.001, 54))
    assert epsilon_spent(0.148, 0.001, 54, 1e-5) == pytest.approx(oracle.get_epsilon(1e-5))


@pytest.mark.thorough
def test_the_smallest_noise_inside_composed_events_decides():
    below = [_steps(0.1, 1.0, 10), _releases(0.2, 3)]
    assert smallest_noise_multiplier(dp_accounting.ComposedDpEvent(below)) == 0.2
    with pytest.raises(ValueError, match=r"\(got 0.2\)"):
        composed_epsilon(below, 1e-5, "pld")
    at_floor = [_steps(0.1, 1.0, 10), _releases(PLD_MIN_NOISE_MULTIPLIER, 3)]
    oracle = dp_accounting.pld.PLDAccountant().compose(dp_accounting.ComposedDpEvent(at_floor))
    assert composed_epsilon(at_floor, 1e-5, "pld") == pytest.approx(oracle.get_epsilon(1e-5))


def test_pld_calibration_does_not_search_below_the_floor():
    loose = epsilon_spent(0.01, PLD_MIN_NOISE_MULTIPLIER, 10, 1e-5, "pld") * 2
    with pytest.raises(ValueError, match=r"noise_multiplier=0.3 already meets it"):
        calibrate_noise_multiplier(loose, 1e-5, 0.01, 10, "pld")


@pytest.mark.parametrize(("overrides", "accountant"), [
    (["privacy.accountant=pld"], "privacy.accountant"),
    (["budget.name=b", "budget.epsilon=10", "budget.delta=1e-5", "budget.accountant=pld"],
     "budget.accountant"),
])
def test_a_pipeline_with_pld_and_a_tiny_sigma_is_refused_by_field(overrides, accountant):
    with pytest.raises(PipelineError) as refused:
        rt.Pipeline.from_yaml(ROOT / "pipelines/quickstart.yaml",
                              overrides=["privacy.noise_multiplier=0.001", *overrides])
    assert (f"privacy.noise_multiplier: 0.001 is below 0.3, the smallest the pld accountant "
            f"({accountant}) can account in memory: raise it, or set {accountant}: rdp"
            ) in str(refused.value)


def test_a_run_at_a_tiny_sigma_under_rdp_reports_pld_as_not_computed(
        ray_session, tmp_path, capsys):
    pipeline = rt.Pipeline.from_yaml(ROOT / "pipelines/quickstart.yaml", overrides=[
        "privacy.noise_multiplier=0.001", "training.epochs=1", "training.workers=1",
        f"run.output_dir={tmp_path}", "run.loggers=[csv]"])
    result = rt.run(pipeline, on_line=None, on_epoch=None)
    assert result.status == "completed"
    privacy = json.loads(result.record.read_text())["privacy"]
    oracle = dp_accounting.rdp.RdpAccountant().compose(_steps(64 / 800, 0.001, 12))
    assert privacy["steps"] == 12 and privacy["epsilon_pld"] is None
    assert privacy["epsilon_rdp"] == pytest.approx(oracle.get_epsilon(1e-5), rel=1e-9)
    with (result.run_dir / "metrics.csv").open() as file:
        (row,) = csv.DictReader(file)
    assert "epsilon_pld" not in row and float(row["epsilon_rdp"]) == privacy["epsilon_rdp"]
    print_summary(json.loads(result.record.read_text()), result.record)
    assert "PLD accountant        not computed (sigma below its smallest, 0.3)" in (
        capsys.readouterr().out)
    report = subprocess.run([sys.executable, "-m", "raydp_train", "report", str(result.run_dir)],
                            capture_output=True, text=True, check=False)
    assert report.returncode == 0 and "sigma=0.001" in report.stdout, report.stderr
