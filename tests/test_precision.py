"""`training.precision` and `training.use_gpu`: a bf16 forward and backward under autocast with
the clipping math in float32, the fp32 path unchanged, and the step on a CUDA device.

bf16 keeps 8 bits of mantissa (unit roundoff 2^-8 = 0.4%), so the per-example norms of a
bf16 pass differ from float32's by a fraction of a percent: an example whose norm lies that
close to C may be clipped in one precision and not in the other. The tests bound the norm
error, require every decision with a margin above that bound to agree, and require the
overall agreement at a C at the batch's median norm. The GPU tests skip without CUDA.
"""

import copy
import typing

import pytest
import torch
from oracles import engine_sum_in_parameter_order, naive_clipped_sum

from raydp_train.config.pipeline import PipelineError, pipeline_from_dict
from raydp_train.config.training import TrainingConfig
from raydp_train.privacy import layer_rules, rule_registry
from raydp_train.privacy.clipping import PerExampleClipper
from raydp_train.privacy.noise import fill_gaussian_noise_, make_noise_generator
from raydp_train.train.step import (
    AUTOCAST_DTYPES,
    Precision,
    cross_entropy_loss,
    in_precision,
    private_step,
)

transformers = pytest.importorskip("transformers", reason="transformers is a runtime dependency")

BATCH, TOKENS = 128, 8
# bf16 norms vs the float32 oracle's, relative: ~2.5 bf16 unit roundoffs (measured: 0.4%).
NORM_TOLERANCE = 1e-2
# A decision whose norm is this far from C (relative) never differs (measured error: mean
# 0.17%, max 0.4%; 92 of the 128 examples here are that far from the median).
DECISION_MARGIN = 5e-3
# The clipped sum vs the oracle's, relative to its norm (measured: 0.12%).
SUM_TOLERANCE = 2e-2
# At C = the median norm, the share of examples clipped alike in bf16 and float32 (measured:
# 95.3%); the others lie within bf16's error of C (module docstring).
MEDIAN_AGREEMENT = 0.9
CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="needs a CUDA GPU: training.use_gpu runs the step on the device")


def tiny_bert():
    from test_clipping_hf import ARCHITECTURES

    from raydp_train.config.pipeline import HFModel
    from raydp_train.models.hf import build_hf_model

    torch.manual_seed(0)
    config = HFModel(kind="hf", config=ARCHITECTURES["bert"], num_labels=2)
    return build_hf_model(config, num_labels=2)  # float32 parameters, dropout 0


def fixed_batch(batch: int = BATCH, tokens: int = TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, 2, T] token ids and attention mask (lengths 2..T, right padding) and labels."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 40, (batch, tokens), generator=generator)
    lengths = torch.randint(2, tokens + 1, (batch, 1), generator=generator)
    mask = (torch.arange(tokens) < lengths).long()
    labels = torch.randint(0, 2, (batch,), generator=generator)
    return torch.stack([ids * mask, mask], dim=1), labels


def engine_pass(model, tokens, labels, clip_norm: float, precision: str):
    """(per-example norms, clipped sum in parameter order) of one engine pass."""
    clipper = PerExampleClipper(model, clip_norm)
    clipper.zero_grad()
    loss = in_precision(cross_entropy_loss, precision, "cpu")
    stats = clipper.accumulate(loss, model, tokens, labels)
    clipped_sum = engine_sum_in_parameter_order(model, clipper).clone()
    clipper.close()
    return stats.norms, clipped_sum


@pytest.fixture(scope="module")
def bert_and_oracle():
    """The tiny BERT, the fixed batch, and the float64 naive loop's clipped sum and norms at
    C = the median norm."""
    model = tiny_bert()
    tokens, labels = fixed_batch()
    oracle = copy.deepcopy(model).double()
    expected, norms, clip_norm = naive_clipped_sum(oracle, cross_entropy_loss, tokens, labels)
    return model, tokens, labels, expected.float(), norms.float(), clip_norm


@pytest.mark.thorough
def test_bf16_clip_decisions_match_the_float32_oracle(bert_and_oracle):
    model, tokens, labels, expected, oracle_norms, clip_norm = bert_and_oracle
    norms, clipped_sum = engine_pass(model, tokens, labels, clip_norm, "bf16")

    error = ((norms - oracle_norms) / oracle_norms).abs()
    assert error.max() < NORM_TOLERANCE
    agree = (norms > clip_norm) == (oracle_norms > clip_norm)
    clear = (oracle_norms - clip_norm).abs() > DECISION_MARGIN * clip_norm
    assert clear.sum() > BATCH // 2 and agree[clear].all()  # no decision with a margin flips
    assert agree.float().mean() >= MEDIAN_AGREEMENT
    assert (clipped_sum - expected).norm() / expected.norm() < SUM_TOLERANCE
    # The clipped examples' norms are exact for the gradient bf16 computed: the sum's norm is
    # at most B C whatever the precision (the sensitivity the privacy analysis uses).
    assert clipped_sum.norm() <= BATCH * clip_norm


@pytest.mark.thorough
def test_fp32_engine_agrees_with_the_oracle_on_every_decision(bert_and_oracle):
    """The reference the bf16 test is measured against: float32 decides as float64 does."""
    model, tokens, labels, expected, oracle_norms, clip_norm = bert_and_oracle
    norms, clipped_sum = engine_pass(model, tokens, labels, clip_norm, "fp32")
    assert ((norms > clip_norm) == (oracle_norms > clip_norm)).all()
    assert (clipped_sum - expected).norm() / expected.norm() < 1e-5


def test_bf16_runs_the_forward_in_bf16_and_the_norm_math_in_float32(monkeypatch):
    recorded, normed = set(), set()
    cast = rule_registry.cast_recorded

    def spy_cast(calls, dtype):
        recorded.update(g.dtype for layer in calls for g in layer.output_grads)
        cast(calls, dtype)

    def spy_norm(a, g, gram_cache, key):
        normed.update((a.dtype, g.dtype))
        return original_norm(a, g, gram_cache, key)

    original_norm = layer_rules.linear_weight_norm
    monkeypatch.setattr("raydp_train.privacy.clipping.cast_recorded", spy_cast)
    monkeypatch.setattr(layer_rules, "linear_weight_norm", spy_norm)
    model = tiny_bert()
    tokens, labels = fixed_batch(8)
    norms, clipped_sum = engine_pass(model, tokens, labels, 1.0, "bf16")
    assert torch.bfloat16 in recorded  # autocast really ran the layers in bf16
    assert normed == {torch.float32}
    assert norms.dtype == clipped_sum.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_cast_recorded_casts_a_shared_input_once_and_keeps_float32_as_is():
    shared = torch.randn(2, 3, 4, dtype=torch.bfloat16)
    ids, kept = torch.tensor([[1, 2]]), torch.randn(2, 3, 4)
    query = rule_registry.LayerCalls(inputs=[shared], output_grads=[kept])
    key = rule_registry.LayerCalls(inputs=[shared.detach()], output_grads=[None])
    embedding = rule_registry.LayerCalls(inputs=[ids], output_grads=[kept])
    rule_registry.cast_recorded([query, key, embedding], torch.float32)
    assert query.inputs[0].dtype == torch.float32 and query.inputs[0] is key.inputs[0]
    assert query.output_grads[0] is kept and key.output_grads == [None]
    assert embedding.inputs[0] is ids


def _one_step(precision: str | None, device: str = "cpu", noise_std: float = 0.0):
    """Parameters after one seeded private step of the tiny BERT (precision None: the step's
    default)."""
    model = tiny_bert().to(device)
    tokens, labels = fixed_batch(16)
    clipper = PerExampleClipper(model, 0.5)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    generator, _ = make_noise_generator("fast", 3, device)
    options = {} if precision is None else {"precision": precision}
    private_step(model, clipper, optimizer, [(tokens.to(device), labels.to(device))],
                 cross_entropy_loss, noise_std, 16.0, generator, **options)
    clipper.close()
    return torch.cat([p.detach().flatten() for p in model.parameters()]).cpu()


def test_fp32_precision_changes_nothing():
    assert in_precision(cross_entropy_loss, "fp32", "cpu") is cross_entropy_loss
    fp32, default = _one_step("fp32", noise_std=0.1), _one_step(None, noise_std=0.1)
    assert torch.equal(fp32, default)
    assert not torch.equal(_one_step("bf16", noise_std=0.1), fp32)  # the setting does act


def test_unknown_precision_is_refused_naming_the_field():
    raw = {"name": "p", "data": {"source": "synthetic"}, "model": {"kind": "mlp"},
           "privacy": {"noise_multiplier": 1.0}, "training": {"precision": "fp16"}}
    with pytest.raises(PipelineError, match="training.precision"):
        pipeline_from_dict(raw)
    assert pipeline_from_dict({**raw, "training": {}}).training.precision == "fp32"
    choices = typing.get_args(TrainingConfig.model_fields["precision"].annotation)
    assert set(choices) == set(AUTOCAST_DTYPES) == set(typing.get_args(Precision))
    assert pipeline_from_dict({**raw, "training": {"precision": "bf16"}}).training.precision \
        == "bf16"


def test_the_worker_steps_in_the_configured_precision(monkeypatch):
    from raydp_train.train import worker
    from raydp_train.train.context import LocalContext
    from raydp_train.train.plan import make_plan

    seen = []

    def spy_step(*args, **kwargs):
        seen.append(args[10] if len(args) > 10 else kwargs.get("precision", "fp32"))
        return private_step(*args, **kwargs)

    monkeypatch.setattr(worker, "private_step", spy_step)
    pipeline = pipeline_from_dict({
        "name": "digits", "data": {"source": "sklearn_digits"},
        "model": {"kind": "mlp", "hidden_sizes": [32]}, "privacy": {"noise_multiplier": 1.0},
        "training": {"epochs": 1, "batch_size": 256, "lr": 0.5, "precision": "bf16"},
        "run": {"seed": 0}})
    plan = make_plan(pipeline, 1438)
    result = worker.train(pipeline, plan, LocalContext(on_epoch=lambda row: None))
    assert seen and set(seen) == {"bf16"} and len(seen) == plan.steps
    assert all(p.dtype == torch.float32 for p in result.model.parameters())


# ------------------------------------------------------------------------------ on a GPU


@CUDA
@pytest.mark.parametrize("precision, tolerance", [("fp32", 1e-5), ("bf16", 2e-2)])
def test_private_step_on_cuda_equals_the_cpu_step(precision, tolerance):
    """Model, clipping and the update on the device give the CPU step's parameters (bf16:
    against the float32 CPU step, within bf16's error)."""
    before = torch.cat([p.detach().flatten() for p in tiny_bert().parameters()])
    on_cpu, on_cuda = _one_step("fp32"), _one_step(precision, "cuda")
    change = on_cpu - before
    assert (on_cuda - on_cpu).norm() / change.norm() < tolerance


@CUDA
def test_noise_is_drawn_on_the_device():
    generator, mode = make_noise_generator("fast", 5, "cuda")
    assert mode == "seeded" and generator.device.type == "cuda"
    model = tiny_bert().cuda()
    clipper = PerExampleClipper(model, 1.0)
    noise = clipper.bind_grads()
    fill_gaussian_noise_(noise, 2.0, generator)
    assert noise.device.type == "cuda" and noise.dtype == torch.float32
    assert 1.9 < noise.std().item() < 2.1  # ~3,000 entries
    assert all(p.grad.device.type == "cuda" for p in clipper.parameters)
    clipper.close()


@CUDA
def test_bf16_step_on_cuda_keeps_float32_state():
    model = tiny_bert().cuda()
    tokens, labels = fixed_batch(8)
    clipper = PerExampleClipper(model, 1.0)
    loss = in_precision(cross_entropy_loss, "bf16", "cuda")
    stats = clipper.accumulate(loss, model, tokens.cuda(), labels.cuda())
    assert stats.norms.device.type == "cuda" and stats.norms.dtype == torch.float32
    assert clipper.flat_grad.dtype == torch.float32
    clipper.close()
