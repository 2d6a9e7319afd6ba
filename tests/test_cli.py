"""`raydp-train validate | run` end to end on the quickstart pipeline (in-process, no Ray)."""

from pathlib import Path

import pytest
from dp_accounting import GaussianDpEvent, PoissonSampledDpEvent, SelfComposedDpEvent
from dp_accounting.rdp import RdpAccountant

from raydp_train.commands.cli import main

QUICKSTART = str(Path(__file__).parents[1] / "pipelines" / "quickstart.yaml")


def direct_epsilon(accountant, q=0.08, sigma=2.0, steps=375, delta=1e-5):
    event = SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(sigma)), steps)
    return accountant.compose(event).get_epsilon(delta)


def test_validate_prints_plan_with_dp_accounting_epsilon(capsys):
    assert main(["validate", QUICKSTART]) == 0
    out = capsys.readouterr().out
    assert "sampling rate q         0.08 " in out
    assert "steps                   375" in out
    assert f"epsilon {direct_epsilon(RdpAccountant()):.4f}" in out
    assert "noise_multiplier: 2.0" in out  # the resolved pipeline is printed


def test_validate_calibrates_sigma_for_a_target_epsilon(capsys):
    overrides = ["--set", "privacy.noise_multiplier=null", "--set", "privacy.target_epsilon=2.0"]
    assert main(["validate", QUICKSTART, *overrides]) == 0
    out = capsys.readouterr().out
    assert "calibrated to target_epsilon" in out
    line = next(x for x in out.splitlines() if x.startswith("will spend"))
    assert 1.999 <= float(line.split()[3]) <= 2.0


@pytest.mark.slow
def test_bad_pipeline_exits_with_a_message_naming_the_field(capsys):
    assert main(["run", QUICKSTART, "--set", "privacy.noise_multiplier=-1"]) == 2
    err = capsys.readouterr().err
    assert "privacy.noise_multiplier: must be >= 0.001, got -1" in err


@pytest.mark.slow
def test_batch_larger_than_dataset_is_refused_before_training(tmp_path, capsys):
    args = ["run", QUICKSTART, "--set", "training.batch_size=5000",
            "--set", f"run.output_dir={tmp_path}"]
    assert main(args) == 2
    assert "training.batch_size" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing trained, nothing written


def test_seeded_secure_noise_is_refused_before_anything_is_written(tmp_path, capsys):
    args = ["run", QUICKSTART, "--set", "run.noise=secure", "--set", "run.seed=1",
            "--set", f"run.output_dir={tmp_path}"]
    assert main(args) == 2
    assert "run.noise: secure noise cannot be seeded: remove run.seed" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_resume_refuses_a_run_directory_of_another_pipeline(tmp_path, capsys):
    (tmp_path / "pipeline.yaml").write_text("name: other\n")
    assert main(["run", QUICKSTART, "--resume", str(tmp_path)]) == 2
    assert "is a different pipeline" in capsys.readouterr().err


def test_report_of_a_missing_run_is_a_clear_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "no run record" in capsys.readouterr().err


@pytest.mark.slow
def test_output_into_a_closed_pipe_ends_quietly():
    """`raydp-train report RUN | head`: the reader is gone before we write; no BrokenPipeError
    traceback. (`true` exits without reading, so every write hits a closed pipe.)"""
    import subprocess
    import sys

    shell = f"{sys.executable} -m raydp_train validate {QUICKSTART} | true"
    done = subprocess.run(shell, shell=True, capture_output=True, text=True, timeout=120,
                          check=False)
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr


def test_a_model_that_never_took_a_step_is_not_for_release():
    from types import SimpleNamespace

    from raydp_train.config.pipeline import load_pipeline
    from raydp_train.reports.run import privacy_statement
    from raydp_train.train.plan import make_plan

    plan = make_plan(load_pipeline(QUICKSTART), 1000)
    for steps, for_release in ((0, False), (plan.steps, True)):
        # What privacy_statement reads of a TrainResult (whose module would import Ray).
        result = SimpleNamespace(noise_mode="fast", steps_done=steps, steps_charged=steps,
                                 releases_charged=0, stop_reason="completed")
        assert privacy_statement(plan, result, workers=1)["for_release"] is for_release


def test_the_summary_says_which_noise_a_run_used(capsys):
    from types import SimpleNamespace

    from raydp_train.config.pipeline import load_pipeline
    from raydp_train.privacy.noise import NOISE_SOURCES
    from raydp_train.reports.console import print_summary
    from raydp_train.reports.run import privacy_statement
    from raydp_train.train.plan import make_plan

    plan = make_plan(load_pipeline(QUICKSTART), 1000)
    result = SimpleNamespace(noise_mode="secure", steps_done=plan.steps,
                             steps_charged=plan.steps, releases_charged=0, stop_reason="completed",
                             metrics=[], trained_per_step=10, model_parameters=10)
    record = {"privacy": privacy_statement(plan, result, workers=1), "metrics": [],
              "training": {"trained_numbers_per_step": 10, "model_parameters": 10}}
    print_summary(record, "record.json")
    assert f"noise                   secure: {NOISE_SOURCES['secure']}" in capsys.readouterr().out
