"""Every shipped pipeline loads, and the privacy numbers its header promises are the ones the
accounting gives (so a changed recipe cannot leave a stale claim behind)."""

import re
from pathlib import Path

import pytest

from raydp_train.accounting.epsilon import composed_epsilon
from raydp_train.checks.sweep_spending import random_stopping_spend, worst_trial_spend
from raydp_train.config.pipeline import load_pipeline
from raydp_train.train.plan import make_plan

PIPELINES = sorted((Path(__file__).parents[1] / "pipelines").glob("*.yaml"))
SST2_TRAIN_SENTENCES = 6920  # GLUE SST-2 sentence split, as ../shared/data/sst2 holds it


@pytest.mark.parametrize("path", PIPELINES, ids=lambda p: p.name)
def test_every_shipped_pipeline_loads(path):
    pipeline = load_pipeline(str(path))
    assert pipeline.name == path.stem.replace("_", "-")


def test_the_sst2_sweep_header_states_what_the_search_spends():
    path = next(p for p in PIPELINES if p.name == "sst2_minilm_sweep.yaml")
    header = path.read_text()
    pipeline = load_pipeline(str(path))
    plan = make_plan(pipeline, SST2_TRAIN_SENTENCES)
    per_trial = composed_epsilon([worst_trial_spend(pipeline, plan).dp_event()], plan.delta,
                                 plan.accountant)
    search = composed_epsilon([random_stopping_spend(pipeline, plan).dp_event()], plan.delta,
                              plan.accountant)
    claimed = re.search(r"spends\s+epsilon ([\d.]+), the\s+(?:# )?whole search ([\d.]+)", header)
    assert claimed, "the header must state the costliest trial's and the whole search's epsilon"
    assert float(claimed[1]) == pytest.approx(per_trial, abs=0.005)
    assert float(claimed[2]) == pytest.approx(search, abs=0.005)
    assert search <= pipeline.budget.epsilon  # the budget it names can pay the search
