"""DP-SGD on a real local Ray Train worker group (one shared Ray session; few, small runs)."""

import json
import math
from dataclasses import replace
from pathlib import Path

import faults
import pytest
import ray
import torch
from dp_accounting import GaussianDpEvent, PoissonSampledDpEvent, SelfComposedDpEvent
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant
from faults import AccountantOnRankZeroOnly, FailOnce

from raydp_train.commands.cli import main
from raydp_train.config.pipeline import pipeline_from_dict
from raydp_train.data.sources import load_data
from raydp_train.models.builders import build_model
from raydp_train.privacy.clipping import PerExampleClipper
from raydp_train.privacy.mechanism import mechanism_named
from raydp_train.train.charges import planned_charges
from raydp_train.train.plan import make_plan
from raydp_train.train.step import cross_entropy_loss
from raydp_train.train.trainer import fit

ray.cloudpickle.register_pickle_by_value(faults)  # the workers cannot import the tests folder
QUICKSTART = str(Path(__file__).parents[1] / "pipelines" / "quickstart.yaml")


def released_or_one_more(released: int) -> tuple[int, int]:
    """The steps a run with an injected failure counts: those released, and possibly the one
    rank 0 marked and drew noise for before it learnt that rank 1 had failed."""
    return released, released + 1
SIGMA, CLIP = 50.0, 1.0


def small_pipeline(workers, **training):
    return pipeline_from_dict({
        "name": "dist",
        "data": {"source": "synthetic", "n_samples": 800},
        "model": {"kind": "mlp", "hidden_sizes": [128]},
        "privacy": {"noise_multiplier": SIGMA, "clip_norm": CLIP, "delta": 1e-5},
        "training": {"epochs": 2, "batch_size": 64, "lr": 1.0, "workers": workers, **training},
        "run": {"seed": 11, "max_failures": 1},
    })


def fit_given_rows(pipeline, plan, run_dir, **options):
    """`fit` with the rows the driver loaded, as `raydp-train run` calls it (each worker then
    takes its share rather than making the synthetic data again: no sklearn import there)."""
    return fit(pipeline, plan, run_dir, dataset=load_data(pipeline.data), **options)


def initial_parameters(pipeline):
    data = load_data(pipeline.data).to_torch()
    torch.manual_seed(pipeline.run.seed)
    model = build_model(pipeline.model, data.feature_shape, data.num_classes)
    return model, data


def flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("workers", [1, 2])
def test_noise_is_one_draw_per_step_whatever_the_world_size(ray_session, tmp_path, workers):
    """Update std over the run = sqrt(T) sigma C / (qN): one draw per step, not one per worker.

    sigma is large so the clipped gradients (norm <= C per example) are negligible next to the
    noise (~0.1% of its variance); 2 draws per step would show as sqrt(2) = +41%.
    """
    pipeline = small_pipeline(workers)
    plan = make_plan(pipeline, 640)
    model, _ = initial_parameters(pipeline)
    # Epoch 1 ends at step 10: from then on rank 1 has no accountant loaded (only rank 0's
    # row is published).
    result = fit_given_rows(pipeline, plan, tmp_path / "run", on_epoch=lambda row: None,
                            after_step=AccountantOnRankZeroOnly(15))
    assert not (tmp_path / "run" / AccountantOnRankZeroOnly.MARKER).exists()
    total_update = flat(result.model) - flat(model)
    expected = plan.steps**0.5 * SIGMA * CLIP / plan.expected_batch_size
    assert result.steps_done == plan.steps == 20
    assert total_update.std().item() == pytest.approx(expected, rel=0.05)
    # The last step's reduced sum, before / qN: one draw of std sigma C (not sqrt(W) sigma C).
    assert result.final_step_sum_std == pytest.approx(SIGMA * CLIP, rel=0.05)
    # Every worker ends with bit-identical parameters (fit also refuses otherwise).
    assert len(result.checksums) == workers and len(set(result.checksums)) == 1


def test_noiseless_distributed_step_equals_single_process_clipped_sum(ray_session, tmp_path):
    """sigma = 0, q = 1: one step over every example, split across 2 workers' shards."""
    pipeline = small_pipeline(2, epochs=1, batch_size=640)
    plan = make_plan(pipeline, 640)
    plan = replace(plan, noise_multiplier=0.0)
    model, data = initial_parameters(pipeline)
    clipper = PerExampleClipper(model, CLIP)
    clipper.accumulate(cross_entropy_loss, model, data.train_features, data.train_labels)
    expected = flat(model) - clipper.flat_grad / 640.0  # SGD, lr 1, divide by q N = 640
    clipper.close()
    result = fit_given_rows(pipeline, plan, tmp_path / "run", on_epoch=lambda row: None)
    assert result.steps_done == 1
    torch.testing.assert_close(flat(result.model), expected, rtol=1e-6, atol=1e-6)


def test_worker_failure_resumes_and_counts_every_step_run(ray_session, tmp_path):
    pipeline = small_pipeline(2, epochs=3)  # epochs end at steps 10, 20, 30 (q = 0.1)
    plan = make_plan(pipeline, 640)
    rows = []
    result = fit_given_rows(pipeline, plan, tmp_path / "run", on_epoch=rows.append,
                            after_step=FailOnce(15))
    assert (tmp_path / "run" / ".injected_failure").exists()  # it did fail once
    assert result.steps_done == 30
    # Epoch 2 was charged before it ran, released steps 10-14, and rank 1 failed; after the
    # restart from the epoch-1 checkpoint it was charged and run again. The steps released
    # count, not the dead attempt's whole epoch: 10 + 5 + 20, and step 15 if rank 0 had
    # drawn its noise before it learnt of the failure.
    assert result.steps_charged in released_or_one_more(10 + 5 + 20)
    assert result.metrics[-1]["epsilon"] == pytest.approx(plan.epsilon(result.steps_charged))
    assert [r["epoch"] for r in result.metrics] == [1, 2, 3]


# make test: test_charges.py's test_run_account_never_charges_past_its_epsilon_cap and the
# restart of test_worker_failure_resumes_and_counts_every_step_run
@pytest.mark.long
def test_a_restart_never_takes_a_calibrated_run_past_its_target_epsilon(ray_session, tmp_path):
    """The restart after a crash in epoch 2 (5 of its steps released) charges epoch 2 again;
    the third epoch would then pass privacy.target_epsilon, so the run stops after the
    second and says why."""
    base = small_pipeline(2, epochs=3).model_dump()
    pipeline = pipeline_from_dict({**base, "privacy": {"target_epsilon": 2.0, "clip_norm": CLIP,
                                                       "delta": 1e-5}})
    plan = make_plan(pipeline, 640)
    assert plan.noise_calibrated and plan.epsilon(30) <= 2.0 < plan.epsilon(35)
    result = fit_given_rows(pipeline, plan, tmp_path / "run", on_epoch=lambda row: None,
                            after_step=FailOnce(15))
    assert result.stop_reason.startswith("target epsilon reached")
    assert result.steps_done == 20 and result.steps_charged in released_or_one_more(25)
    assert plan.epsilon(result.steps_charged) <= 2.0
    assert [r["epoch"] for r in result.metrics] == [1, 2]


# make test: test_charges.py's test_a_run_under_a_reservation_made_elsewhere_never_charges_
# past_it and the restart of test_worker_failure_resumes_and_counts_every_step_run
@pytest.mark.long
def test_a_restart_never_takes_a_random_stopping_trial_past_its_reservation(ray_session,
                                                                            tmp_path):
    """A sweep's one reservation pays for each trial's planned steps (fixed sigma: no target
    to stop at). The restart after a crash in epoch 2 (5 of its steps released) charges epoch
    2 again; the third epoch would then charge more than was reserved, so the trial stops
    after the second."""
    pipeline = small_pipeline(2, epochs=3)
    plan = make_plan(pipeline, 640)
    result = fit_given_rows(pipeline, plan, tmp_path / "run", on_epoch=lambda row: None,
                            after_step=FailOnce(15), ceiling=planned_charges(plan))
    assert result.stop_reason.startswith("reservation used up")
    assert result.steps_done == 20 and result.steps_charged in released_or_one_more(25)


def test_cli_run_on_ray_then_report(ray_session, tmp_path, capsys):
    args = ["run", QUICKSTART, "--set", f"run.output_dir={tmp_path}",
            "--set", "training.epochs=30", "--set", "training.workers=2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    event = SelfComposedDpEvent(PoissonSampledDpEvent(0.08, GaussianDpEvent(2.0)), 375)
    rdp = RdpAccountant().compose(event).get_epsilon(1e-5)
    pld = PLDAccountant().compose(event).get_epsilon(1e-5)
    assert abs(rdp - 4.007) < 5e-3 and abs(pld - 3.672) < 5e-3
    assert "epoch  30/30  step    375" in out
    assert f"RDP accountant        epsilon {rdp:.4f}" in out
    assert f"PLD accountant        epsilon {pld:.4f}" in out
    run_dir = next(tmp_path.glob("quickstart-*"))
    privacy = json.loads((run_dir / "privacy.json").read_text())
    assert privacy["steps"] == 375 and privacy["workers"] == 2
    assert privacy["epsilon"] == pytest.approx(rdp, rel=1e-12)
    assert privacy["noise_mode"] == "fast" and privacy["for_release"] is True

    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "375 steps, 2 worker(s)" in out
    for plot in ("epsilon_vs_steps.png", "accuracy_vs_epoch.png", "accuracy_vs_epsilon.png"):
        assert (run_dir / plot).stat().st_size > 1000
    # the quickstart's 200 test rows: 100 of each class
    record = json.loads((run_dir / "record.json").read_text())
    assert record["baselines"] == {"chance": 0.5, "test_majority_class": 0.5}


# make test: test_worker_failure_resumes_and_counts_every_step_run (the checkpoint, every step
# counted), test_optim.py's test_schedule_state_survives_resume
@pytest.mark.long
def test_interrupted_run_resumes_from_its_last_checkpoint(ray_session, tmp_path):
    """A run that failed for good (no restarts left) continues with `fit` on the same run dir,
    as `raydp-train run --resume RUN_DIR` does, and still counts the lost steps."""
    from ray.train import TrainingFailedError

    pipeline = pipeline_from_dict({**small_pipeline(2, epochs=3, schedule="cosine").model_dump(),
                                   "run": {"seed": 11, "max_failures": 0}})
    plan = make_plan(pipeline, 640)
    with pytest.raises(TrainingFailedError):
        fit_given_rows(pipeline, plan, tmp_path / "run", on_epoch=lambda row: None,
                       after_step=FailOnce(15))
    result = fit_given_rows(pipeline, plan, tmp_path / "run", on_epoch=lambda row: None)
    assert result.steps_done == 30 and result.steps_charged in released_or_one_more(35)
    assert [r["epoch"] for r in result.metrics] == [1, 2, 3]
    # The schedule went on from the checkpoint's step 10, not from 0: lr(k) = lr (1 + cos(pi k
    # / 30)) / 2 after k = 10, 20, 30 steps.
    cosine = [0.5 * (1 + math.cos(math.pi * k / 30)) for k in (10, 20, 30)]
    assert [r["lr"] for r in result.metrics] == pytest.approx(cosine, abs=1e-12)


def test_epsilon_does_not_depend_on_the_number_of_workers():
    one, two = make_plan(small_pipeline(1), 640), make_plan(small_pipeline(2), 640)
    assert one == two and one.epsilon() == two.epsilon()


def test_lsg_on_two_workers_adds_one_draw_to_the_kept_entries_only(ray_session, tmp_path):
    pipeline = pipeline_from_dict({
        **small_pipeline(2).model_dump(),
        "privacy": {"noise_multiplier": SIGMA, "clip_norm": CLIP, "delta": 1e-5,
                    "mechanism": "lsg", "lsg": {"rank": 4, "sparsity": 0.5}},
    })
    plan = make_plan(pipeline, 640)
    # LSG accounting = DP-SGD accounting: the same plan but for the mechanism.
    assert plan == replace(make_plan(small_pipeline(2), 640), mechanism=mechanism_named("lsg"))
    result = fit_given_rows(pipeline, plan, tmp_path / "run", on_epoch=lambda row: None)
    # Only the 20 -> 128 layer is adapted (the 128 -> 2 head has min(n, m) = 2 <= rank 4):
    # kept carriers (128 - 64) * 4 + (20 - 10) * 4 = 296, its bias 128, the head's 258.
    assert result.trained_per_step == 296 + 258 + 128
    assert result.final_step_sum_std == pytest.approx(SIGMA * CLIP, rel=0.05)
    assert len(set(result.checksums)) == 1
