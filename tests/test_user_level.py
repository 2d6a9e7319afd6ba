"""privacy.unit user without Ray: sampling users, their rows on one worker, the checks of the
user column and of the pipeline, the accounting over users, and a local run
(ARCHITECTURE.md §2.14)."""

import math

import dp_accounting
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from raydp_train.checks.pipeline_checks import check_data_and_plan
from raydp_train.config.errors import PipelineError
from raydp_train.config.pipeline import pipeline_from_dict
from raydp_train.data.sources import load_data
from raydp_train.data.users import UserRowsWarning
from raydp_train.errors import DataError
from raydp_train.privacy.user_sampling import (
    sample_user_rows,
    user_rows,
    whole_user_micro_batches,
)
from raydp_train.reports.run import unit_words
from raydp_train.train.context import LocalContext
from raydp_train.train.plan import make_plan
from raydp_train.train.samplers import MemorySampler
from raydp_train.train.worker import train


def write_users_file(path, rows=240, users=40, seed=0, user_values=None):
    rng = np.random.default_rng(seed)
    features = rng.normal(size=(rows, 4)).astype(np.float32)
    labels = (features[:, 0] + 0.3 * rng.normal(size=rows) > 0).astype(np.int64)
    authors = user_values if user_values is not None else [
        f"author-{u}" for u in rng.integers(0, users, rows)]
    table = pa.table({**{f"f{i}": features[:, i] for i in range(4)}, "label": labels,
                      "author": authors})
    pq.write_table(table, path)
    return path


def user_pipeline(tmp_path, **privacy):
    train_file = write_users_file(tmp_path / "train.parquet")
    test_file = write_users_file(tmp_path / "test.parquet", rows=80, seed=1)
    settings = {"noise_multiplier": 1.0, "clip_norm": 1.0, "unit": "user",
                "rows_per_user": 4, **privacy}
    return pipeline_from_dict({
        "name": "users", "model": {"kind": "mlp", "hidden_sizes": [8], "num_classes": 2},
        "data": {"source": "parquet", "path": str(train_file), "test_path": str(test_file),
                 "feature_columns": ["f0", "f1", "f2", "f3"], "user_column": "author"},
        "privacy": settings,
        "training": {"epochs": 2, "batch_size": 8, "max_physical_batch": 16, "lr": 0.1},
        "run": {"seed": 0},
    })


def test_users_are_sampled_whole_and_capped():
    user_of_row = torch.tensor([3, 1, 3, 3, 3, 1, 0, 3, 0, 3])
    index = user_rows(user_of_row)
    rows, users = sample_user_rows(index, 1.0, 3, torch.Generator().manual_seed(0))
    assert sorted(set(users.tolist())) == [0, 1, 3]
    counts = torch.bincount(users)
    assert counts[3] == 3 and counts[1] == 2 and counts[0] == 2
    assert torch.equal(user_of_row[rows], users)  # each row is its user's
    chunks = whole_user_micro_batches(rows, users, 4)
    assert all(len(chunk) <= 4 for chunk, _ in chunks)
    seen = [set(chunk_users.tolist()) for _, chunk_users in chunks]
    assert all(not (a & b) for i, a in enumerate(seen) for b in seen[i + 1:])  # never split


def test_each_users_rows_live_on_one_worker(tmp_path):
    pipeline = user_pipeline(tmp_path)
    dataset = load_data(pipeline.data, 2)
    shards = [dataset.rows(rank, 2) for rank in range(2)]
    assert sum(s.num_train for s in shards) == dataset.num_train
    assert not set(shards[0].train_users.tolist()) & set(shards[1].train_users.tolist())
    assert dataset.num_units == len(set(dataset.train_users.tolist())) < dataset.num_train


def test_the_user_column_is_checked_like_labels(tmp_path):
    nulls = write_users_file(tmp_path / "n.parquet", rows=4, user_values=["a", None, "b", "a"])
    with pytest.raises(DataError, match="data.user_column: 'author' .* 1 null rows"):
        load_data(user_pipeline(tmp_path).data.model_copy(update={"path": str(nulls)}), 2)
    one = write_users_file(tmp_path / "o.parquet", rows=4, user_values=["a"] * 4)
    with pytest.raises(DataError, match="names one user only"):
        load_data(user_pipeline(tmp_path).data.model_copy(update={"path": str(one)}), 2)


@pytest.mark.parametrize("change, field", [
    ({"privacy": {"unit": "example", "noise_multiplier": 1.0}}, "data.user_column"),
    ({"privacy": {"unit": "user", "noise_multiplier": 1.0, "rows_per_user": 64}},
     "privacy.rows_per_user"),
    ({"privacy": {"unit": "user", "noise_multiplier": 1.0}}, "privacy.rows_per_user"),
    ({"privacy": {"unit": "example", "noise_multiplier": 1.0, "user_contribution": "mean"},
      "data": {"source": "synthetic"}}, "privacy.user_contribution"),
])
def test_the_pipeline_refuses_what_user_level_privacy_cannot_serve(tmp_path, change, field):
    raw = user_pipeline(tmp_path).model_dump(mode="json", exclude_none=True)
    raw.update(change)
    with pytest.raises(PipelineError, match=field):
        pipeline_from_dict(raw)


def test_accounting_counts_users_as_dp_accounting_does(tmp_path):
    pipeline = user_pipeline(tmp_path)
    with pytest.warns(UserRowsWarning, match="more than privacy.rows_per_user = 4"):
        dataset, plan = check_data_and_plan(pipeline, for_training=True)
    users = len(set(dataset.train_users.tolist()))
    assert plan.unit == "user" and plan.num_examples == users
    assert plan.sampling_rate == 8 / users and plan.steps == 2 * users // 8
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.PoissonSampledDpEvent(
        8 / users, dp_accounting.GaussianDpEvent(1.0)), plan.steps)
    expected = accountant.get_epsilon(pipeline.privacy.delta)
    assert math.isclose(plan.epsilon(), expected, rel_tol=1e-9)


def test_a_step_samples_users_each_with_at_most_the_cap(tmp_path):
    pipeline = user_pipeline(tmp_path)
    dataset = load_data(pipeline.data, 2).to_torch()
    plan = make_plan(pipeline, dataset.num_units)
    sampler = MemorySampler(dataset, None, torch.Generator().manual_seed(0), plan.sampling_rate,
                            16, "cpu", plan.rows_per_user)
    sizes = []
    for _ in range(20):
        batches = list(sampler.step_batches())
        assert all(len(b) == 3 and b[2].shape == b[1].shape for b in batches)
        users = torch.cat([b[2] for b in batches]) if batches else torch.empty(0)
        assert (torch.bincount(users.long()) <= 4).all()
        sizes.append(users.unique().numel())
    assert abs(np.mean(sizes) - 8) < 3  # about B = 8 users a step, not 8 rows


@pytest.mark.parametrize("mechanism", ["dpsgd", "lsg", "lora"])
def test_a_user_level_run_trains_locally(tmp_path, mechanism):
    extra = {mechanism: {"rank": 2, "layers": ["1"]}} if mechanism != "dpsgd" else {}
    pipeline = user_pipeline(tmp_path, mechanism=mechanism, **extra)
    dataset = load_data(pipeline.data, 2)
    plan = make_plan(pipeline, dataset.num_units)
    result = train(pipeline, plan, LocalContext(on_epoch=lambda row: None), dataset.to_torch())
    assert result.steps_done == plan.steps
    assert result.metrics[-1]["epsilon"] == pytest.approx(plan.epsilon())
    assert result.self_checks[0][0] >= 1  # the rows' self-check ran before the first release


def test_a_mean_per_user_run_trains_and_says_so(tmp_path):
    pipeline = user_pipeline(tmp_path, user_contribution="mean")
    dataset = load_data(pipeline.data, 2)
    plan = make_plan(pipeline, dataset.num_units)
    assert plan.user_contribution == "mean"
    clipper = plan.mechanism(pipeline.privacy, torch.Generator()).attach(
        torch.nn.Linear(4, 2), 1.0)
    assert clipper.contribution == "mean"  # the engine averages each user's rows
    clipper.close()
    result = train(pipeline, plan, LocalContext(on_epoch=lambda row: None), dataset.to_torch())
    assert result.steps_done == plan.steps
    privacy = {"unit": "user", "rows_per_user": 4, "user_contribution": "mean"}
    assert unit_words(privacy) == "per user (all of a user's rows; at most 4 a step, their mean)"
    assert unit_words(privacy | {"user_contribution": "sum"}).endswith("at most 4 a step)")


def test_the_audit_plants_a_canary_user_clipped_once(tmp_path, monkeypatch):
    """Without noise the watched weight shows exactly the canary user's clipped share s, never
    its 4 rows' 4 s (what clipping each row would give); with noise, the audit stays within
    the claim."""
    from raydp_train.checks.preflight import check_pipeline
    from raydp_train.commands.audit import _CanaryRuns, audit_pipeline

    pipeline = user_pipeline(tmp_path, noise_multiplier=4.0)
    dataset, plan = check_pipeline(pipeline)
    result = audit_pipeline(pipeline, dataset, plan, trials=10, seed=0)
    assert result.unit == "user" and result.consistent
    monkeypatch.setattr("raydp_train.train.step.fill_gaussian_noise_",
                        lambda tensor, std, generator: tensor.zero_())
    runs = _CanaryRuns(pipeline, dataset, plan, seed=0)
    generator = torch.Generator().manual_seed(0)
    shown = {round(x / runs.signal, 6) for x in runs.train(True, generator, generator)}
    runs.close()
    assert shown == {0.0, 1.0}
