"""Randomized soundness: hundreds of generated models against a naive per-example loop.

Each model (tests/random_models.py) is checked in float64 twice, once with every example
clipped and once with none, the batch cut into two micro-batches: the engine's clipped sum and
per-example norms must equal the oracle's to 1e-9 (shared parameters and hooks included), or
the engine must refuse it by name: always when a layer is re-parametrized, and when a trained
weight used outside its layer sends a gradient to the loss (otherwise the numbers must be
exact). `make test` runs 300 models; `pytest tests/test_soundness_random.py
--long` runs 5,000 (`--long=N` for N). A failure prints the smallest failing model found by
deleting operations, as a script that reproduces it.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from oracles import per_example_grads
from random_models import Program, generate

from raydp_train.privacy.clipping import PerExampleClipper, UnsupportedLayerError

pytestmark = pytest.mark.usefixtures("float64")

TOLERANCE = 1e-9
REFUSAL_WORDS = {"functional": "own layer's forward",
                 "reparametrized": ("does not compute", "has no rule")}
MAY_GIVE_NUMBERS = {"functional"}  # a use whose gradient never reaches the loss is harmless


def build(program: Program):
    """Run the program's own reproduction script: the model, its inputs and labels."""
    namespace: dict = {}
    script = program.script()
    # The generated script is the test's own model: exec keeps the reproduction exact.
    exec(compile(script, f"<generated model, seed {program.seed}>", "exec"), namespace)  # noqa: S102
    inputs = (namespace["x"], namespace["ids"], namespace["mask"])
    return namespace["model"], inputs, namespace["labels"]


def naive_per_example_grads(model, inputs, labels) -> torch.Tensor:
    """[B, P]: the oracle (tests/oracles.py) for the generated model's several inputs."""
    return per_example_grads(model, multi_input_losses, inputs, labels)


def multi_input_losses(model, inputs: tuple, labels):
    return F.cross_entropy(model(*inputs), labels, reduction="none")


def engine_clipped_sum(model, inputs, labels, clip_norm):
    """The clipped sum over two micro-batches (one, for a batch of one), and the norms."""
    clipper = PerExampleClipper(model, clip_norm)
    half = max(1, labels.shape[0] // 2)
    try:
        norms = torch.cat([
            clipper.accumulate(
                lambda part=part: F.cross_entropy(model(*(t[part] for t in inputs)),
                                                  labels[part], reduction="none")
            ).norms
            for part in (slice(0, half), slice(half, None)) if labels[part].numel()
        ])
        by_param = {id(p): p.grad.flatten() for p in clipper.parameters}
        flat = torch.cat([by_param[id(p)] for p in model.parameters() if p.requires_grad])
        return flat, norms
    finally:
        clipper.close()
        for p in model.parameters():
            p.grad = None


def failure(program: Program, outcomes: Counter | None = None) -> str | None:
    """None if the engine is exact (or rightly refuses); else what went wrong. `outcomes`
    counts "exact" and "refused"."""
    outcomes = Counter() if outcomes is None else outcomes
    model, inputs, labels = build(program)
    refusals = program.expected_refusals()
    try:
        per_example = naive_per_example_grads(model, inputs, labels)
    except (RuntimeError, ValueError) as error:
        return f"generator bug: the oracle itself fails: {error}"
    true_norms = per_example.norm(dim=1)
    positive = true_norms[true_norms > 0]
    every = 0.5 * positive.min().item() if positive.numel() else 1.0
    for clip_norm in (every, 2 * true_norms.max().item() + 1.0):
        try:
            got, norms = engine_clipped_sum(model, inputs, labels, clip_norm)
        except UnsupportedLayerError as error:
            words = [w for r in refusals for w in _as_tuple(REFUSAL_WORDS[r])]
            if any(w in str(error) for w in words):
                outcomes["refused"] += 1
                return None
            return f"refused: {error}"
        if refusals - MAY_GIVE_NUMBERS:
            return f"expected a refusal ({', '.join(sorted(refusals))}), got numbers"
        factors = (clip_norm / true_norms.clamp(min=clip_norm)).unsqueeze(1)
        expected = (per_example * factors).sum(0)
        error = torch.linalg.norm(got - expected).item()
        if error > TOLERANCE * torch.linalg.norm(expected).item() + 1e-12:
            return f"clip norm {clip_norm:.3g}: clipped sum off by {error:.3g}"
        if not torch.allclose(norms, true_norms, rtol=TOLERANCE, atol=1e-12):
            return f"clip norm {clip_norm:.3g}: norms {norms.tolist()} != {true_norms.tolist()}"
    outcomes["exact"] += 1
    return None


def _as_tuple(words) -> tuple:
    return words if isinstance(words, tuple) else (words,)


def minimal(program: Program) -> Program:
    """Delete operations while the model still fails."""
    shrunk = True
    while shrunk:
        shrunk = False
        for index in range(len(program.ops)):
            smaller = program.without(index)
            if failure(smaller) is not None:
                program, shrunk = smaller, True
                break
    return program


def reproduction(program: Program, reason: str) -> str:
    return f"# generated model, seed {program.seed}: {reason}\n{program.script()}"


@pytest.mark.thorough
def test_generated_models_are_exact_or_refused(request):
    count = request.config.getoption("--long") or 300
    failures, kinds, outcomes = [], Counter(), Counter()
    for seed in range(count):
        program = generate(seed)
        kinds.update(_features(program))
        reason = failure(program, outcomes)
        if reason is not None:
            failures.append(program)
            if len(failures) >= 3:
                break
    print(f"\n{count} generated models: {outcomes['exact']} exact, {outcomes['refused']} "
          f"rightly refused, {len(failures)} failing; {dict(sorted(kinds.items()))}")
    if failures:
        smallest = minimal(failures[0])
        pytest.fail(
            f"{len(failures)} failing model(s), seeds {[p.seed for p in failures]}; smallest:\n"
            + reproduction(smallest, failure(smallest))
        )
    # The generator must keep producing the shapes this suite exists for.
    for feature in ("in-place on a layer output", "in-place residual add", "shared input",
                    "layer called twice", "keyword call", "frozen", "padding mask",
                    "tied", "functional", "conv2d", "conv1d raw", "embedding", "unused output",
                    "shared weight", "shared bias", "shared norm scale", "shared embedding",
                    "shared kernel", "bias shared with a norm", "output hook",
                    "input pre-hook", "custom Function", "data-dependent stray use",
                    "weight_norm"):
        assert kinds[feature] >= count // 100, (feature, kinds)


def _features(program: Program) -> set[str]:
    lines = [op.line for op in program.ops]
    layer_reads = Counter(op.reads[0] for op in program.ops if op.module and op.reads)
    features = {
        "in-place on a layer output": any(line.endswith("_()") for line in lines),
        "in-place residual add": any("+=" in line for line in lines),
        "shared input": any(n > 1 for n in layer_reads.values()),
        "layer called twice": any(op.uses and not (op.refusal or op.tied) for op in program.ops),
        "keyword call": any("input=" in line for line in lines),
        "frozen": bool(program.frozen),
        "padding mask": any("mask[" in line for line in lines),
        "tied": any(op.tied for op in program.ops),
        "functional": any(op.refusal == "functional" for op in program.ops),
        "conv2d": any("Conv2d" in (op.module_source or "") for op in program.ops),
        "conv1d raw": any("Conv1d" in (op.module_source or "") and ".transpose" not in op.line
                          for op in program.ops),
        "embedding": any("Embedding" in (op.module_source or "") for op in program.ops),
        "unused output": bool(program.dropped_from_head),
        "shared weight": _shares(program, "nn.Linear", "weight"),
        "shared bias": _shares(program, "nn.Linear", "bias"),
        "shared norm scale": _shares(program, "Norm", "weight"),
        "shared embedding": _shares(program, "nn.Embedding", "weight"),
        "shared kernel": _shares(program, "nn.Conv", "weight"),
        "bias shared with a norm": any(op.shares and op.module_source.startswith("nn.LayerNorm")
                                       and op.shares[0][1] == "bias" and
                                       op.module_source != _source_of(program, op.uses[0])
                                       for op in program.ops),
        "output hook": any("forward_hook" in (op.hook or "") for op in program.ops),
        "input pre-hook": any("pre_hook" in (op.hook or "") for op in program.ops),
        "custom Function": any("Matmul.apply" in line for line in lines),
        "data-dependent stray use": any(" if bool(" in line for line in lines),
        "weight_norm": any(op.refusal == "reparametrized" for op in program.ops),
    }
    return {name for name, present in features.items() if present}


def _source_of(program: Program, module: str) -> str | None:
    return next((op.module_source for op in program.ops if op.module == module), None)


def _shares(program: Program, kind: str, attribute: str) -> bool:
    return any(op.shares and kind in op.module_source and (attribute, attribute) in op.shares
               for op in program.ops)
