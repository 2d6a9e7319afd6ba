"""The zoo of real architectures (tests/zoo_models.py): for each, the clipping engine's clipped
sum and per-example norms over two micro-batches against the naive per-example loop (float64,
every example clipped): exact, refused (why), crashed or WRONG, the modules that took the
per-example path and the seconds the check took. Writes its section of RESULTS.md.

    .venv/bin/python benchmarks/model_zoo.py            (under a minute)
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(ROOT / "tests"))
from step_overhead import machine_facts, write_section
from zoo_models import BATCH, EXACT, KNOWN_BUGS, MICRO_BATCHES, TOKENS, ZOO, Outcome, check

RESULTS = Path(__file__).with_name("RESULTS.md")
# Counted as exact: to 1e-9, or to float32 rounding where the model computes in float32.
EXACT_OUTCOMES = ("exact", "exact to float32")
NOTES = """\
Every example is clipped (C = half the smallest per-example norm); relative error = the larger
of max |sum - loop| / max |loop| and the largest relative error of a norm. *exact to float32*:
the model's RMSNorm classes compute in float32 inside a float64 model while their rule computes
the formula in float64; with the norm weights frozen, Llama, Qwen3 and Phi-3 are exact to
3e-15. Dropout (and drop-path, layer-drop) set to 0 in every config that has one (the column
says which fields): the naive loop would otherwise draw other masks than the engine's pass,
and a module on the per-example path that draws random numbers is refused by name.
torchvision and timm are not in the zoo: neither installs against the CPU torch of this
environment. The T5 and MPNet rows "one micro-batch of T examples" probe, on purpose, a
micro-batch of as many examples as a relative position table has rows, where the shape check
alone once took the table's rows for examples: the first pass's probe of the example axis (the
batch grown by one row) finds the lookup shared by the examples, and the table takes the
per-example path with one backward per example (ARCHITECTURE.md §2.3), as Swin's and BEiT's
tables do. OPT's and Swin's Linear layers read tokens or windows folded into the first axis
([B T, d]); CLIP's and SigLIP's position tables are looked up with [1, N] ids and expanded to
the batch. DeBERTa-v2 reads its relative embeddings' weight outside the Embedding's forward
(freeze it to train the rest). ResNet with BatchNorm is refused by design: BatchNorm mixes the
examples of a batch (the fix, model.fix: GroupNorm, is the row below it)."""


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def row(name: str, result: Outcome) -> str:
    outcome = result.outcome if result.outcome in EXACT_OUTCOMES else (
        f"**{result.outcome}**: {result.detail}")
    if result.outcome in EXACT_OUTCOMES:
        outcome += f" ({result.detail})"
    if name in KNOWN_BUGS:
        outcome += f" -- known: {KNOWN_BUGS[name]}"
    path = ", ".join(f"`{module}`" for module in result.per_example_path) or "-"
    return (f"| {cell(name)} | {cell(outcome)} | {path} | {ZOO[name].dropout or '-'} | "
            f"{result.seconds:.2f} |")


def machine_line() -> str:
    return (f"Machine: {machine_facts()}; 1-minute load {os.getloadavg()[0]:.1f} at the end "
            "(the seconds are the check's wall time, other work included).")


def section(results: dict[str, Outcome]) -> str:
    counts = {kind: sum(r.outcome == kind for r in results.values())
              for kind in ("exact", "exact to float32", "refused", "crashed", "WRONG")}
    exact = counts["exact"] + counts["exact to float32"]
    sizes = " and ".join(str(rows.stop - rows.start) for rows in MICRO_BATCHES)
    method = (f"{len(results)} architectures in tiny configs (random init, built from code; "
              f"hidden 8-16, 1-2 layers), float64, a batch of {BATCH} ({TOKENS} tokens or an "
              f"8x8 image) cut into micro-batches of {sizes}, the engine (`PerExampleClipper`) "
              "against the naive per-example loop (tests/oracles.py); exact: relative error "
              f"< {EXACT:g}. The test: tests/test_model_zoo.py.")
    summary = (f"**Exact: {exact} of {len(results)} ({exact / len(results):.0%}; "
               f"{counts['exact']} to 1e-9, {counts['exact to float32']} to float32 rounding); "
               f"refused by name: {counts['refused']}; crashed: {counts['crashed']}; WRONG: "
               f"{counts['WRONG']}** (target: at least 90% exact, 0 wrong).")
    header = ("| architecture | outcome | modules on the per-example path | dropout set to 0 "
              "| seconds |")
    return "\n".join([
        "## Model zoo (benchmarks/model_zoo.py)", "", machine_line(), "",
        method, "", header, "|---|---|---|---|---:|",
        *(row(name, result) for name, result in results.items()), "", summary, "", NOTES])


def main() -> None:
    torch.set_num_threads(2)
    torch.set_default_dtype(torch.float64)
    warnings.filterwarnings("ignore")
    results = {}
    for name in ZOO:
        results[name] = check(name)
        print(row(name, results[name]), flush=True)
    text = section(results)
    print("\n" + text.rsplit("\n\n", 2)[-2])
    write_section(RESULTS, text)


if __name__ == "__main__":
    main()
