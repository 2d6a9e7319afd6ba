"""A private validation file under privacy.unit user (ARCHITECTURE.md §2.14): its accuracy is
released per user, the sum of each user's share of rows predicted right plus Gaussian noise,
so removing a whole user moves the released sum by at most 1 (tested leave-one-user-out
against a naive loop), and the run's epsilon composes its releases with the steps over users
as dp-accounting does."""

import math

import dp_accounting
import pytest
import torch

from raydp_train.config.errors import PipelineError
from raydp_train.config.pipeline import pipeline_from_dict
from raydp_train.data.sources import load_data
from raydp_train.data.targets import LABEL_KINDS
from raydp_train.train.context import LocalContext
from raydp_train.train.evaluation import held_out_scores
from raydp_train.train.plan import make_plan
from raydp_train.train.worker import train
from tests.test_user_level import write_users_file

RELEASE_SIGMA = 4.0


def validation_pipeline(tmp_path, **validation):
    files = {name: write_users_file(tmp_path / f"{name}.parquet", rows=rows, seed=seed)
             for name, rows, seed in (("train", 240, 0), ("test", 80, 1), ("valid", 120, 2))}
    validation = {"path": str(files["valid"]), "noise_multiplier": RELEASE_SIGMA} | validation
    return pipeline_from_dict({
        "name": "users", "model": {"kind": "mlp", "hidden_sizes": [8], "num_classes": 2},
        "data": {"source": "parquet", "path": str(files["train"]),
                 "test_path": str(files["test"]), "feature_columns": ["f0", "f1", "f2", "f3"],
                 "user_column": "author", "validation": validation},
        "privacy": {"noise_multiplier": 1.0, "clip_norm": 1.0, "unit": "user",
                    "rows_per_user": 4},
        "training": {"epochs": 2, "batch_size": 8, "max_physical_batch": 16, "lr": 0.1},
        "run": {"seed": 0},
    })


def _scored(model, features, labels, users):
    return held_out_scores(model, features, labels, LABEL_KINDS["class"], users)[:2]


def test_the_released_sum_moves_by_at_most_one_when_a_user_leaves():
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(60, 4, generator=generator)
    labels = torch.randint(0, 2, (60,), generator=generator)
    users = torch.randint(0, 9, (60,), generator=generator)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    right = (model(features).argmax(1) == labels).double()
    naive = sum(right[users == u].mean().item() for u in users.unique())  # share per user
    shares, count = _scored(model, features, labels, users)
    assert count == len(users.unique()) and math.isclose(shares, naive, rel_tol=1e-12)
    moved = []
    for user in users.unique():
        keep = users != user
        without, _ = _scored(model, features[keep], labels[keep], users[keep])
        moved.append(abs(shares - without))
        # The count per row would move by the user's right rows: more than 1 for some.
    assert max(moved) <= 1 + 1e-12
    assert max(right[users == u].sum().item() for u in users.unique()) > 1


def test_the_validation_file_is_split_by_user_and_its_releases_accounted(tmp_path):
    pipeline = validation_pipeline(tmp_path)
    dataset = load_data(pipeline.data, 2)
    assert dataset.validation_users is not None and len(dataset.validation_users) == 120
    shards = [dataset.rows(rank, 2) for rank in range(2)]
    assert sum(len(s.validation_labels) for s in shards) == 120
    assert not (set(shards[0].validation_users.tolist())
                & set(shards[1].validation_users.tolist()))
    plan = make_plan(pipeline, dataset.num_units)
    assert plan.release_noise_multiplier == RELEASE_SIGMA
    steps = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        plan.sampling_rate, dp_accounting.GaussianDpEvent(1.0)), plan.steps)
    releases = dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(RELEASE_SIGMA), 2)
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.ComposedDpEvent([steps, releases]))
    expected = accountant.get_epsilon(pipeline.privacy.delta)
    assert plan.sampling_rate == 8 / dataset.num_units
    assert math.isclose(plan.epsilon(), expected, rel_tol=1e-9)
    result = train(pipeline, plan, LocalContext(on_epoch=lambda row: None), dataset.to_torch())
    assert result.releases_charged == 2
    assert all("validation_accuracy" in row for row in result.metrics)


@pytest.mark.parametrize(("validation", "field"), [
    ({"path": None, "fraction": 0.2}, "data.validation.fraction"),
    ({"noise_multiplier": None}, "data.validation.noise_multiplier"),
])
def test_a_validation_split_per_user_needs_its_own_file_and_noise(tmp_path, validation, field):
    with pytest.raises(PipelineError, match=field) as refused:
        validation_pipeline(tmp_path, **validation)
    assert "privacy.unit user" in str(refused.value)
