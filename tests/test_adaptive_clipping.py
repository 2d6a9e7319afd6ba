"""privacy.clipping: adaptive (Andrew et al. 2021): C follows a target quantile of the norms
through a noisy count per step. Checked in float64 against a naive per-example loop given the
same seeded noise (the clipped sum at each step's C, and the C sequence), the count's noise
drawn once per step and all-reduced with the sums (two threads as two workers), and the
composed epsilon against dp-accounting called directly on the noise the step really adds."""

from __future__ import annotations

import math
import threading

import dp_accounting
import pytest
import torch
import torch.nn.functional as F
from dp_accounting import pld, rdp
from oracles import per_example_grads
from torch import nn

from raydp_train.config.pipeline import PipelineError, pipeline_from_dict
from raydp_train.privacy.adaptive_clipping import QuantileClipping
from raydp_train.privacy.clipping import PerExampleClipper
from raydp_train.privacy.mechanism import make_mechanism
from raydp_train.train.plan import PlanError, make_plan
from raydp_train.train.step import private_step

C0, Z, COUNT_NOISE, TARGET, ETA, EXPECTED = 0.3, 1.1, 0.9, 0.6, 0.5, 6.0


def losses(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _batches(step: int, rows: int = 7):
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(rows, 5, generator=generator, dtype=torch.float64) * (1 + step)
    return x, torch.randint(0, 3, (rows,), generator=generator)


def _engine(model):
    return PerExampleClipper(model, C0, quantile=QuantileClipping(C0, TARGET, ETA, COUNT_NOISE))


def test_each_step_is_the_naive_loop_at_that_steps_c_given_the_seeded_noise():
    model, naive = _model(), _model()
    engine = _engine(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    params = list(naive.parameters())
    offsets = None
    clip_norm, seen = C0, []
    z_grad = (Z ** -2 - (2 * COUNT_NOISE) ** -2) ** -0.5  # the paper's, written out here
    for step in range(6):
        x, y = _batches(step)
        private_step(model, engine, optimizer, [(x[:4], y[:4]), (x[4:], y[4:])], losses,
                     Z * C0, EXPECTED, torch.Generator().manual_seed(step))
        if offsets is None:  # where each parameter's gradient sits in the engine's buffer
            offsets = [(p.grad.data_ptr() - engine.flat_grad.data_ptr()) // 8
                       for p in model.parameters()]
        # The naive way: one backward per example, clip at this step's C, the same draws.
        grads = per_example_grads(naive, losses, x, y)
        norms = grads.norm(dim=1)
        clipped = (grads * torch.clamp(clip_norm / norms, max=1).unsqueeze(1)).sum(0)
        draws = torch.Generator().manual_seed(step)
        noise = torch.empty(engine.flat_grad.numel(), dtype=torch.float64).normal_(
            0.0, z_grad * clip_norm, generator=draws)
        count_noise = torch.empty(1, dtype=torch.float64).normal_(0.0, COUNT_NOISE,
                                                                  generator=draws)
        start = 0
        with torch.no_grad():
            for p, q, offset in zip(params, model.parameters(), offsets, strict=True):
                size = p.numel()
                expected = (clipped[start:start + size] + noise[offset:offset + size]) / EXPECTED
                torch.testing.assert_close(q.grad.flatten(), expected, rtol=1e-10, atol=1e-12)
                p -= 0.1 * expected.view_as(p)
                start += size
        count = ((norms <= clip_norm).double() - 0.5).sum() + count_noise
        clip_norm *= math.exp(-ETA * (float(count) / EXPECTED + 0.5 - TARGET))
        assert engine.clip_norm == pytest.approx(clip_norm, rel=1e-12)
        seen.append(clip_norm)
    assert len({round(c, 9) for c in seen}) == len(seen)  # C moved at every step
    engine.close()


class TwoWorkers:
    """all_reduce_sum across two threads: each rank's tensor summed into both."""

    def __init__(self):
        self.barrier, self.parts, self.calls = threading.Barrier(2), {}, []

    def all_reduce_sum(self, rank: int):
        def reduce(tensor):
            self.calls.append((rank, tensor.numel()))
            self.parts[rank] = tensor.clone()
            self.barrier.wait()
            tensor.copy_(self.parts[0] + self.parts[1])
            self.barrier.wait()
        return reduce


def test_two_workers_draw_the_counts_noise_once_and_reduce_it_with_the_sums():
    """Two workers on halves of each sample (noise on rank 0 alone) end every step as one
    worker on the whole sample: the same gradients, the same C; one collective per step."""
    one, ranks = _model(), [_model(), _model()]
    engines = [_engine(m) for m in (one, *ranks)]
    world = TwoWorkers()

    def run(rank: int) -> None:
        model, engine = ranks[rank], engines[1 + rank]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(4):
            x, y = _batches(step, rows=8)
            half = slice(0, 5) if rank == 0 else slice(5, 8)  # unequal shards
            private_step(model, engine, optimizer, [(x[half], y[half])], losses,
                         Z * C0 if rank == 0 else 0.0, EXPECTED,
                         torch.Generator().manual_seed(step), world.all_reduce_sum(rank))

    threads = [threading.Thread(target=run, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    optimizer = torch.optim.SGD(one.parameters(), lr=0.1)
    for step in range(4):
        x, y = _batches(step, rows=8)
        private_step(one, engines[0], optimizer, [(x[:5], y[:5]), (x[5:], y[5:])], losses,
                     Z * C0, EXPECTED, torch.Generator().manual_seed(step))
    for rank in (0, 1):
        assert engines[1 + rank].clip_norm == pytest.approx(engines[0].clip_norm, rel=1e-12)
        for p, q in zip(one.parameters(), ranks[rank].parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
    size = engines[0].flat_grad.numel() + 1  # the buffer and the count, together
    assert sorted(world.calls) == [(0, size)] * 4 + [(1, size)] * 4
    for engine in engines:
        engine.close()


def _pipeline(**privacy):
    raw = {"name": "t", "data": {"source": "synthetic"}, "model": {"kind": "logistic"},
           "training": {"batch_size": 64, "epochs": 3},
           "privacy": {"noise_multiplier": Z, "clipping": "adaptive", **privacy}}
    return pipeline_from_dict(raw)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_the_composed_epsilon_is_dp_accountings_of_the_noise_the_step_adds(accountant):
    pipeline = _pipeline(accountant=accountant, adaptive={"count_noise": 2.5})
    plan = make_plan(pipeline, 1000)
    quantile = QuantileClipping(plan.clip_norm, count_noise=2.5)
    gradient_std = quantile.start_step(plan.noise_multiplier * plan.clip_norm,
                                       plan.expected_batch_size, torch.zeros(3), plan.clip_norm)
    # What the step adds: the gradient's noise (sensitivity C) and the count's (sensitivity 1/2).
    z = ((gradient_std / plan.clip_norm) ** -2 + (2 * quantile.count_std) ** -2) ** -0.5
    event = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        plan.sampling_rate, dp_accounting.GaussianDpEvent(z)), plan.steps)
    direct = (rdp.RdpAccountant() if accountant == "rdp"
              else pld.PLDAccountant(value_discretization_interval=1e-4))
    direct.compose(event)
    assert plan.epsilon() == pytest.approx(direct.get_epsilon(plan.delta), rel=1e-9)
    assert gradient_std > plan.noise_multiplier * plan.clip_norm  # the count is paid for
    assert quantile.count_std == 2.5


def test_the_count_noise_default_is_the_expected_batch_over_20_and_too_little_is_refused():
    plan = make_plan(_pipeline(), 1000)
    quantile = QuantileClipping(1.0)
    quantile.start_step(Z, plan.expected_batch_size, torch.zeros(1), 1.0)
    assert quantile.count_std == 64 / 20
    with pytest.raises(PlanError, match=r"privacy\.adaptive\.count_noise: .* above 0\.55"):
        make_plan(_pipeline(adaptive={"count_noise": 0.5}), 1000)
    with pytest.raises(PipelineError, match="privacy.adaptive: only allowed with clipping"):
        pipeline_from_dict({"name": "t", "data": {"source": "synthetic"},
                            "model": {"kind": "logistic"},
                            "privacy": {"noise_multiplier": 1.0, "adaptive": {}}})


@pytest.mark.parametrize("mechanism", ["dpsgd", "lsg", "lora"])
def test_every_mechanism_clips_at_the_moving_c(mechanism):
    raw = {"name": "t", "data": {"source": "synthetic"}, "model": {"kind": "logistic"},
           "privacy": {"mechanism": mechanism, "noise_multiplier": 1.0, "clipping": "adaptive",
                       **({mechanism: {"rank": 2}} if mechanism != "dpsgd" else {})}}
    privacy = pipeline_from_dict(raw).privacy
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    chosen = make_mechanism(privacy, torch.Generator().manual_seed(0))
    engine = chosen.attach(model, 0.1)
    assert engine.quantile is not None and engine.quantile.target_quantile == 0.5
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    norms = []
    for step in range(3):
        x, y = torch.randn(16, 6), torch.arange(16) % 3
        chosen.refresh(step, 1)
        private_step(model, engine, optimizer, [(x, y)], lambda m, a, b: losses(m, a, b),
                     1.0 * 0.1, 16.0, torch.Generator().manual_seed(step), mechanism=chosen)
        norms.append(engine.clip_norm)
    assert norms[0] != 0.1 and len(set(norms)) == 3
    engine.close()


def test_the_own_loops_private_step_clips_adaptively_and_checks_the_count_noise_first():
    import raydp_train as rt

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3))
    arguments = {"clip_norm": 1.0, "expected_batch_size": 20, "num_examples": 40,
                 "delta": 1e-3, "clipping": "adaptive"}
    with pytest.raises(rt.UserError, match=r"PrivateStep adaptive: count_noise: .* above 1\.5"):
        rt.PrivateStep(model, torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=3.0,
                       adaptive={"count_noise": 1.0}, **arguments)
    private = rt.PrivateStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
                             noise_multiplier=1.0, seed=0, **arguments)
    inputs, labels = torch.randn(40, 5), torch.arange(40) % 3
    norms = []
    for _ in range(3):
        rows = private.sample(40)
        private.step(inputs[rows], labels[rows])
        norms.append(private.clipper.clip_norm)
    assert private.clipper.quantile is not None and len({1.0, *norms}) == 4
