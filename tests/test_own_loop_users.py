"""`PrivateStep(unit="user")` in a user's own loop (ARCHITECTURE.md §2.11, §2.14): the step
releases the naive per-user clipped sum plus one noise draw (float64), removing one user moves
it by at most C, epsilon counts users (dp-accounting), and bad input is refused on one line
before anything is reserved; on 2 Ray Train workers, a user on both workers is refused and
each worker's users are clipped whole."""

import sys

import dp_accounting
import pytest
import torch
from ray import cloudpickle

import raydp_train as rt
from raydp_train.budget.actor import BudgetClient
from raydp_train.privacy.rule_registry import UnsupportedLayerError
from raydp_train.train.own_loop import PrivateStepError
from raydp_train.train.own_loop_users import LoopUsers
from tests.oracles import clip_and_sum, per_example_grads

USERS, ROWS, B, C, SIGMA, K = 12, 60, 4, 0.5, 2.0, 3


def _data():
    generator = torch.Generator().manual_seed(3)
    inputs = torch.randn(ROWS, 5, generator=generator, dtype=torch.float64) * 2
    labels = torch.randint(0, 2, (ROWS,), generator=generator)
    users = torch.randint(0, USERS, (ROWS,), generator=generator)
    users[:USERS] = torch.arange(USERS)  # every user has a row
    return inputs, labels, users


def _model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(5, 16, dtype=torch.float64), torch.nn.Tanh(),
                               torch.nn.Linear(16, 2, dtype=torch.float64))


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _losses(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y, reduction="none")


def _step(rows, batch_of, users_of=None, **settings) -> torch.Tensor:
    """The parameters after one seeded step (lr 1) on `batch_of(sampled rows)`."""
    model = _model()
    inputs, labels, users = _data()
    arguments = dict(clip_norm=C, noise_multiplier=SIGMA, expected_batch_size=B,  # noqa: C408
                     num_examples=USERS, delta=1e-3, seed=5, unit="user",
                     rows_per_user=K) | settings
    with rt.PrivateStep(model, torch.optim.SGD(model.parameters(), lr=1.0),
                        **arguments) as private:
        (x, y), ids = private.sample((inputs, labels), users=users)
        rows.extend(zip(x.tolist(), y.tolist(), ids.tolist(), strict=True))
        keep = batch_of(ids)
        private.step(x[keep], y[keep], users=ids[keep])
    return _flat(model)


def _naive_user_sum(model, x, y, ids, contribution="sum", clip_norm=C):
    """sum over users of clip(sum, or mean, of the user's per-row gradients)."""
    grads = per_example_grads(model, _losses, x, y)
    reduce = (lambda g: g.sum(0)) if contribution == "sum" else (lambda g: g.mean(0))
    per_user = torch.stack([reduce(grads[ids == u]) for u in ids.unique()])
    return clip_and_sum(per_user, clip_norm)


def test_the_step_releases_the_naive_per_user_clipped_sum_and_one_noise_draw():
    rows = []
    with_data = _step(rows, lambda ids: torch.ones_like(ids, dtype=torch.bool))
    noise_only = _step([], lambda ids: torch.zeros_like(ids, dtype=torch.bool))
    x = torch.tensor([r[0] for r in rows], dtype=torch.float64)
    y, ids = torch.tensor([r[1] for r in rows]), torch.tensor([r[2] for r in rows])
    assert torch.bincount(ids).max() <= K and len(ids.unique()) >= 2
    assert (torch.bincount(ids) > 1).any()  # a user brings several rows
    expected, norms, _ = _naive_user_sum(_model(), x, y, ids)
    assert (norms > C).any()  # some users clipped
    clipped_sum = (noise_only - with_data) * B  # lr 1: each update is -(noise + sum) / B
    assert torch.max(torch.abs(clipped_sum - expected)) / expected.abs().max() < 1e-9
    # Not the per-row clipped sum: this test fails if rows were clipped one by one.
    per_row = clip_and_sum(per_example_grads(_model(), _losses, x, y), C)[0]
    assert torch.max(torch.abs(per_row - expected)) / expected.abs().max() > 1e-3
    noise = (_flat(_model()) - noise_only) * B
    assert noise.std().item() == pytest.approx(SIGMA * C, rel=0.25)  # one draw, 130 entries


def test_removing_one_user_moves_the_release_by_at_most_c():
    rows = []
    full = _step(rows, lambda ids: torch.ones_like(ids, dtype=torch.bool))
    ids = torch.tensor([r[2] for r in rows])
    crowded = int(torch.bincount(ids).argmax())
    assert torch.bincount(ids)[crowded] > 1
    for user in ids.unique().tolist():
        without = _step([], lambda ids, user=user: ids != user)
        assert ((full - without) * B).norm() <= C * (1 + 1e-9)
    # ... while the crowded user's rows, clipped one by one, would move it by more than C.
    x = torch.tensor([r[0] for r in rows], dtype=torch.float64)[ids == crowded]
    y = torch.tensor([r[1] for r in rows])[ids == crowded]
    grads = per_example_grads(_model(), _losses, x, y)
    assert (grads.norm(dim=1) > C).all() and clip_and_sum(grads, C)[0].norm() > 1.1 * C


def test_epsilon_counts_users_as_dp_accounting_does():
    model, (inputs, labels, users) = _model(), _data()
    private = rt.PrivateStep(model, torch.optim.SGD(model.parameters(), lr=0.1), clip_norm=C,
                             noise_multiplier=SIGMA, expected_batch_size=B, num_examples=USERS,
                             delta=1e-3, unit="user", rows_per_user=K)
    for _ in range(7):
        (x, y), ids = private.sample((inputs, labels), users=users)
        private.step(x, y, users=ids)
    private.finish()
    event = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        B / USERS, dp_accounting.GaussianDpEvent(SIGMA)), 7)
    expected = dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(1e-3)
    assert private.epsilon() == pytest.approx(expected, rel=1e-9)
    assert private.plan.unit == "user" and private.plan.rows_per_user == K


class RecordingBudget:
    """A budget handle that records reservations (none may happen before a refusal)."""

    budget, unit = "b", "user"

    def __init__(self):
        self.reserved = []

    def reserve(self, *args):
        self.reserved.append(args)
        raise AssertionError("reserved before the bad input was refused")


def _loop(budget=None, **settings):
    model = _model()
    arguments = dict(clip_norm=C, noise_multiplier=SIGMA, expected_batch_size=B,  # noqa: C408
                     num_examples=USERS, delta=1e-3, unit="user", rows_per_user=K,
                     budget=budget) | settings
    return rt.PrivateStep(model, torch.optim.SGD(model.parameters(), lr=0.1), **arguments)


@pytest.mark.parametrize(("settings", "message"), [
    ({"rows_per_user": None}, r"^PrivateStep rows_per_user: unit='user' needs the cap"),
    ({"rows_per_user": 300}, r"rows_per_user: .*\[1, max_physical_batch = 256\]"),
    ({"unit": "example"}, r"^PrivateStep rows_per_user: only with unit='user'"),
    ({"unit": "person"}, r"^PrivateStep unit: must be one of 'example', 'user'"),
    ({"budget": BudgetClient("team")}, "^PrivateStep budget: 'team' counts epsilon per example"),
])
def test_bad_arguments_are_refused_by_name(settings, message):
    with pytest.raises(PrivateStepError, match=message) as refused:
        _loop(**settings)
    assert "\n" not in str(refused.value)


def test_rows_without_users_and_too_many_users_are_refused_before_a_reservation():
    budget = RecordingBudget()
    inputs, labels, users = _data()
    private = _loop(budget)
    with pytest.raises(PrivateStepError, match=r"^PrivateStep sample: unit='user' needs "
                                                  r"each row's user id: pass users="):
        private.sample((inputs, labels))
    with pytest.raises(PrivateStepError, match="users= must be a 1-D integer tensor"):
        private.sample((inputs, labels), users=users.double())
    with pytest.raises(PrivateStepError, match="call sample.* before its first step"):
        private.step(inputs[:2], labels[:2], users=users[:2])
    (x, y), ids = private.sample((inputs, labels), users=users)
    with pytest.raises(PrivateStepError, match=r"^PrivateStep step: unit='user' needs"):
        private.step(x, y)
    same = torch.zeros(K + 1, dtype=torch.int64)
    with pytest.raises(PrivateStepError, match=f"a user has {K + 1} rows in this step, "
                                                  f"more than rows_per_user = {K}"):
        private.step(inputs[:K + 1], labels[:K + 1], users=same)
    private = _loop(budget, num_examples=USERS + 3)
    (x, y), ids = private.sample((inputs, labels), users=users)
    with pytest.raises(PrivateStepError, match=r"num_examples: with unit='user' it counts "
                                                  f"users .* have {USERS} users, not {USERS + 3}"):
        private.step(x, y, users=ids)
    model = _model()  # the per-example loop takes no user ids
    plain = rt.PrivateStep(model, torch.optim.SGD(model.parameters(), lr=0.1), clip_norm=C,
                           noise_multiplier=SIGMA, expected_batch_size=B, num_examples=ROWS,
                           delta=1e-3)
    with pytest.raises(PrivateStepError, match="users= only with unit='user'"):
        plain.sample((inputs, labels), users=users)
    assert budget.reserved == []


class TwoRanks:
    """The gathered user ids of two ranks, as rank 0 sees them."""

    def __init__(self, other: list[int]):
        self.other = other

    def gather(self, value):
        return [value, self.other]


def test_a_user_on_two_workers_is_refused_naming_the_user_and_the_workers():
    users = LoopUsers(K, 16)
    users.sample(4, torch.tensor([1, 3, 3, 5]), 0.5, torch.Generator().manual_seed(0))
    with pytest.raises(PrivateStepError, match=r"user 3 has rows on workers 0 and 1; "
                                                  "each user's rows must live on one worker"):
        users.check_world(TwoRanks([2, 3, 4]), 5)
    users.check_world(TwoRanks([0, 2, 4]), 6)  # disjoint: 6 users in all
    assert users.world_checked


def users_on_two_workers(config) -> dict:
    """On each rank: a loop whose users include one of the other rank's (refused on every
    rank, before any reservation), then a loop over this rank's own users (u mod 2)."""
    import ray.train

    rank = ray.train.get_context().get_world_rank()
    inputs, labels, users = _data()
    answers = {}
    for name, mine in (("shared", (users % 2 == rank) | (users == 0)), ("own", users % 2 == rank)):
        model = _model()
        try:
            with rt.PrivateStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                clip_norm=C, noise_multiplier=SIGMA, expected_batch_size=B,
                                num_examples=USERS, delta=1e-3, unit="user", rows_per_user=K,
                                budget=config["budget"], owner=name) as private:
                (x, y), ids = private.sample((inputs[mine], labels[mine]), users=users[mine])
                private.step(x, y, users=ids)
            answers[name] = private.epsilon()
        except PrivateStepError as error:
            answers[name] = str(error)
    return answers


# make test: test_a_user_on_two_workers_is_refused_naming_the_user_and_the_workers,
# test_epsilon_counts_users_as_dp_accounting_does, test_own_loop.py's loop on 2 workers
@pytest.mark.long
@pytest.mark.usefixtures("float64")
def test_two_workers_refuse_a_shared_user_and_spend_per_user(ray_session):
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    budget = rt.open_budget("per-user-loop", epsilon=5.0, delta=1e-3, unit="user")
    answers = TorchTrainer(users_on_two_workers, train_loop_config={"budget": budget},
                           scaling_config=ScalingConfig(num_workers=2)).fit().return_value
    assert answers["shared"].startswith("PrivateStep users: user 0 has rows on workers 0 and 1")
    status = budget.status()
    assert "shared" not in status["owners"]  # refused before anything was reserved
    assert status["owners"]["own"]["steps_spent"] == 1
    event = dp_accounting.PoissonSampledDpEvent(B / USERS, dp_accounting.GaussianDpEvent(SIGMA))
    expected = dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(1e-3)
    assert answers["own"] == pytest.approx(expected, rel=1e-9)


def test_the_mean_per_user_step_releases_the_naive_clipped_means():
    rows = []
    everyone = lambda ids: torch.ones_like(ids, dtype=torch.bool)
    mean = {"user_contribution": "mean", "clip_norm": 1.3}  # some users clipped, some not
    with_data = _step(rows, everyone, **mean)
    noise_only = _step([], lambda ids: torch.zeros_like(ids, dtype=torch.bool), **mean)
    x = torch.tensor([r[0] for r in rows], dtype=torch.float64)
    y, ids = torch.tensor([r[1] for r in rows]), torch.tensor([r[2] for r in rows])
    expected, norms, _ = _naive_user_sum(_model(), x, y, ids, "mean", 1.3)
    assert (norms > 1.3).any() and (norms < 1.3).any()
    released = (noise_only - with_data) * B
    assert torch.max(torch.abs(released - expected)) / expected.abs().max() < 1e-9
    summed = (noise_only - _step([], everyone, clip_norm=1.3)) * B  # fails on the sum
    assert torch.max(torch.abs(summed - expected)) / expected.abs().max() > 1e-3
    for user in ids.unique().tolist():
        without = _step([], lambda ids, user=user: ids != user, **mean)
        assert ((with_data - without) * B).norm() <= 1.3 * (1 + 1e-9)
    with pytest.raises(PrivateStepError, match="^PrivateStep user_contribution: must be one"):
        _loop(user_contribution="median")
    with pytest.raises(PrivateStepError, match="user_contribution: only with unit='user'"):
        _loop(unit="example", rows_per_user=None, user_contribution="mean")


@pytest.mark.parametrize(("mechanism", "settings"), [
    ("lsg", {"lsg": {"rank": 2, "layers": ["0"]}}), ("lora", {"lora": {"rank": 2}})])
def test_every_mechanism_clips_users_in_the_own_loop(mechanism, settings):
    private = _loop(mechanism=mechanism, **settings)
    assert private.clipper.unit == "user"
    inputs, labels, users = _data()
    for _ in range(2):
        (x, y), ids = private.sample((inputs, labels), users=users)
        private.step(x, y, users=ids)
    private.finish()
    assert private.epsilon() > 0 and private.steps_released == 2


def test_a_layer_that_cannot_group_rows_is_refused_at_construction():
    model = torch.nn.Sequential(torch.nn.Conv1d(1, 2, 3), torch.nn.Flatten(),
                                torch.nn.Linear(6, 2))
    with pytest.raises(UnsupportedLayerError, match=r"privacy.unit: user .*module '0' \(Conv1d\)"):
        rt.PrivateStep(model, torch.optim.SGD(model.parameters(), lr=0.1), clip_norm=C,
                       noise_multiplier=SIGMA, expected_batch_size=B, num_examples=USERS,
                       delta=1e-3, unit="user", rows_per_user=K, budget=RecordingBudget())
