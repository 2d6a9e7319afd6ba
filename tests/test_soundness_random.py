"""Randomized soundness: hundreds of generated models against a naive per-example loop.

Each model (tests/random_models.py) is checked in float64 twice, once with every example
clipped and once with none: the engine's clipped sum and per-example norms must equal the
oracle's to 1e-9 (tied weights included), or the engine must refuse it by name when the model
uses a trained weight outside its layer. `make test` runs 300 models; `pytest tests/test_soundness_random.py
--long` runs 5,000 (`--long=N` for N). A failure prints the smallest failing model found by
deleting operations, as a script that reproduces it.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from random_models import Program, generate

from raydp_train.privacy.clipping import PerExampleClipper, UnsupportedLayerError

pytestmark = pytest.mark.usefixtures("float64")

TOLERANCE = 1e-9
REFUSAL_WORDS = {"functional": "outside its own layer's forward"}


def build(program: Program):
    """Run the program's own reproduction script: the model, its inputs and labels."""
    namespace: dict = {}
    script = program.script()
    # The generated script is the test's own model: exec keeps the reproduction exact.
    exec(compile(script, f"<generated model, seed {program.seed}>", "exec"), namespace)  # noqa: S102
    inputs = (namespace["x"], namespace["ids"], namespace["mask"])
    return namespace["model"], inputs, namespace["labels"]


def naive_per_example_grads(model, inputs, labels) -> torch.Tensor:
    """[B, P]: one backward per example, over model.parameters() that require grad."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(labels.shape[0]):
        one = tuple(t[i : i + 1] for t in inputs)
        loss = F.cross_entropy(model(*one), labels[i : i + 1], reduction="sum")
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        rows.append(torch.cat([
            (torch.zeros_like(p) if g is None else g).flatten() for p, g in zip(params, grads)
        ]))
    return torch.stack(rows)


def engine_clipped_sum(model, inputs, labels, clip_norm):
    clipper = PerExampleClipper(model, clip_norm)
    try:
        norms = clipper.accumulate(
            lambda: F.cross_entropy(model(*inputs), labels, reduction="none")
        ).norms
        by_param = {id(p): p.grad.flatten() for p in clipper.parameters}
        flat = torch.cat([by_param[id(p)] for p in model.parameters() if p.requires_grad])
        return flat, norms
    finally:
        clipper.close()
        for p in model.parameters():
            p.grad = None


def failure(program: Program) -> str | None:
    """None if the engine is exact (or rightly refuses); else what went wrong."""
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
            if any(REFUSAL_WORDS[r] in str(error) for r in refusals):
                return None
            return f"refused: {error}"
        if refusals:
            return f"expected a refusal ({', '.join(sorted(refusals))}), got numbers"
        factors = (clip_norm / true_norms.clamp(min=clip_norm)).unsqueeze(1)
        expected = (per_example * factors).sum(0)
        error = torch.linalg.norm(got - expected).item()
        if error > TOLERANCE * torch.linalg.norm(expected).item() + 1e-12:
            return f"clip norm {clip_norm:.3g}: clipped sum off by {error:.3g}"
        if not torch.allclose(norms, true_norms, rtol=TOLERANCE, atol=1e-12):
            return f"clip norm {clip_norm:.3g}: norms {norms.tolist()} != {true_norms.tolist()}"
    return None


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


def test_generated_models_are_exact_or_refused(request):
    count = request.config.getoption("--long") or 300
    failures, kinds, refused = [], Counter(), 0
    for seed in range(count):
        program = generate(seed)
        kinds.update(_features(program))
        refused += bool(program.expected_refusals())
        reason = failure(program)
        if reason is not None:
            failures.append(program)
            if len(failures) >= 3:
                break
    print(f"\n{count} generated models: {count - refused} exact, {refused} rightly refused; "
          f"{dict(sorted(kinds.items()))}")
    if failures:
        smallest = minimal(failures[0])
        pytest.fail(
            f"{len(failures)} failing model(s), seeds {[p.seed for p in failures]}; smallest:\n"
            + reproduction(smallest, failure(smallest))
        )
    # The generator must keep producing the shapes this suite exists for.
    for feature in ("in-place on a layer output", "in-place residual add", "shared input",
                    "layer called twice", "keyword call", "frozen", "padding mask",
                    "tied", "functional", "conv2d", "conv1d raw", "embedding", "unused output"):
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
    }
    return {name for name, present in features.items() if present}
