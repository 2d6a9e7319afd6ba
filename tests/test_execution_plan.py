"""The plan resolves the pipeline's mechanism and task once (train/plan.py); the worker trains
with what the plan carries, never by looking a name up again. In-process, no Ray."""

from dataclasses import dataclass, field, replace

import pytest

from raydp_train.config.pipeline import pipeline_from_dict
from raydp_train.data.targets import label_kind
from raydp_train.privacy.mechanism import DpSgd, LowRankSparse, mechanism_named
from raydp_train.train.context import LocalContext
from raydp_train.train.plan import PrivacyPlan, make_plan
from raydp_train.train.tasks import LabelTask, NextTokens
from raydp_train.train.worker import train

# 200 synthetic rows -> N = 160; batch 32 -> q = 0.2: 5 steps per epoch, 2 epochs.
PIPELINE = {
    "name": "plan",
    "data": {"source": "synthetic", "n_samples": 200},
    "model": {"kind": "mlp", "hidden_sizes": [8]},
    "privacy": {"noise_multiplier": 1.0, "clip_norm": 1.0},
    "training": {"epochs": 2, "batch_size": 32},
    "run": {"seed": 3},
}


@dataclass(frozen=True)
class RecordingTask(LabelTask):
    """The label task, noting each time the worker asks it for test metrics."""

    asked: list = field(default_factory=list, compare=False)

    def test_metrics(self, totals):
        self.asked.append(totals)
        return super().test_metrics(totals)


def test_the_plan_carries_the_mechanism_class_and_the_task():
    pipeline = pipeline_from_dict(PIPELINE)
    plan = make_plan(pipeline, 160)
    assert plan.mechanism is DpSgd and plan.task == LabelTask(label_kind(pipeline.data))
    lsg = pipeline_from_dict({**PIPELINE, "privacy": {**PIPELINE["privacy"], "mechanism": "lsg"}})
    assert make_plan(lsg, 160).mechanism is LowRankSparse is mechanism_named("lsg")
    with pytest.raises(TypeError, match="PrivacyPlan.mechanism: a registered Mechanism class"):
        replace(plan, mechanism="lsg")  # a name is never what a plan carries
    assert NextTokens() == NextTokens()


def test_the_worker_trains_with_the_plans_task():
    pipeline = pipeline_from_dict(PIPELINE)
    plan = make_plan(pipeline, 160)
    recording = RecordingTask(plan.task.kind)
    result = train(pipeline, replace(plan, task=recording), LocalContext(on_epoch=lambda r: None))
    assert len(recording.asked) == len(result.metrics) == 2
    assert [row["test_accuracy"] for row in result.metrics] == [
        correct / rows for correct, rows in recording.asked]


def test_a_users_own_loop_plans_without_a_task():
    plan = PrivacyPlan(160, 32, 0.2, 10, 1.0, False, 1.0, 1e-5, "rdp")
    assert plan.task is None and plan.mechanism is DpSgd


@pytest.mark.slow
def test_a_worker_receiving_the_plan_imports_no_dp_accounting():
    """Every Ray Train worker unpickles the plan and imports the training loop; dp-accounting
    (and the scipy it loads, about 2.7 CPU s a process on 2 cores) is imported only where an
    epsilon or an event is computed, which a worker's plan never needs."""
    import pickle
    import subprocess
    import sys

    plan = make_plan(pipeline_from_dict(PIPELINE), 160)
    script = ("import pickle, sys; import raydp_train.train.worker; "
              "pickle.loads(sys.stdin.buffer.read()); "
              "print(sorted(m for m in sys.modules if m.split('.')[0] in "
              "('dp_accounting', 'scipy')))")
    done = subprocess.run([sys.executable, "-c", script], input=pickle.dumps(plan),
                          capture_output=True, check=True)
    assert done.stdout.decode().strip() == "[]", done.stdout.decode()[:500]
