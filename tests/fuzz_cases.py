"""Mutated pipelines and data files, for the fuzz of the whole input surface:
tests/test_input_fuzz.py runs a seeded sample in `make test`, benchmarks/input_fuzz.py the long
mode. Each case is a pipeline file (and the data files it names) in a folder of its own; what
must hold for it is in `check_outcome`.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import signal
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

ROOT = Path(__file__).resolve().parents[1]
BASES = ("quickstart.yaml", "digits_lsg.yaml", "sweep_digits.yaml")
SECONDS = 10  # the longest `validate` may take on any case
# Values that stress types and ranges: wrong types, edges, huge, tiny, non-finite, unicode.
ODD_VALUES = [None, True, False, "", "x" * 5000, "ünïcødé 名前", "../../etc/passwd", -1, 0, 1,
              2**31, 2**63, 2**70, -2**70, 1e308, -1e308, 1e-300, 5e-324, float("nan"),
              float("inf"), float("-inf"), 0.5, [], {}, [1, 2, 3], {"a": 1}, [[[[[[1]]]]]],
              "1e-5", "null", "~", ".", "s3://bucket/key", "/dev/null"]


@dataclass
class Case:
    number: int
    kind: str  # what was mutated
    description: str
    folder: Path
    pipeline: Path


def make_case(number: int, seed: int, folder: Path) -> Case:
    """Case `number` of the stream of `seed`, written under `folder`."""
    rng = random.Random(seed * 1_000_003 + number)
    folder.mkdir(parents=True, exist_ok=True)
    base = rng.choice(BASES)
    raw = yaml.safe_load((ROOT / "pipelines" / base).read_text())
    raw.setdefault("run", {})["output_dir"] = str(folder / "runs")
    if "budget" in raw:
        raw["budget"]["ledger"] = str(folder / "ledger")
    kind = rng.choice(["value", "value", "value", "delete", "unknown", "text", "data", "data",
                       "names"])
    if kind == "names":
        description = _mutate_names(rng, raw, folder)
        text = yaml.safe_dump(raw, allow_unicode=True)
    elif kind == "data":
        description = _mutate_data(rng, raw, folder)
        text = yaml.safe_dump(raw)
    elif kind == "text":
        text, description = _mutate_text(rng, yaml.safe_dump(raw, sort_keys=False))
    else:
        description = _mutate_tree(rng, raw, kind)
        text = yaml.safe_dump(raw, allow_unicode=True)
    pipeline = folder / "pipeline.yaml"
    pipeline.write_text(text)
    return Case(number, kind, f"{base}: {description}", folder, pipeline)


def _paths(node, prefix=()):
    """Every (path, value) in a parsed pipeline, sections included."""
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for key, value in items:
        yield (*prefix, key), value
        if isinstance(value, (dict, list)):
            yield from _paths(value, (*prefix, key))


def _parent(raw, path):
    for key in path[:-1]:
        raw = raw[key]
    return raw


def _mutate_tree(rng: random.Random, raw: dict, kind: str) -> str:
    path, _ = rng.choice(list(_paths(raw)))
    parent, key = _parent(raw, path), path[-1]
    shown = ".".join(map(str, path))
    if kind == "delete":
        del parent[key]
        return f"deleted {shown}"
    if kind == "unknown":
        target = parent if isinstance(parent, dict) else raw
        target[rng.choice(["extra", "noise_multipler", "épochs", "x" * 300])] = rng.choice(
            ODD_VALUES)
        return f"an unknown key beside {shown}"
    value = rng.choice(ODD_VALUES)
    parent[key] = value
    return f"{shown} = {value!r:.60}"


def _mutate_text(rng: random.Random, text: str) -> tuple[str, str]:
    choice = rng.randrange(7)
    if choice == 0:
        cut = rng.randrange(len(text))
        return text[:cut], f"truncated at byte {cut}"
    if choice == 1:
        at = rng.randrange(len(text))
        junk = "".join(rng.choice(":-[]{}&*!|>'\"%@`#\t\x00é") for _ in range(rng.randint(1, 5)))
        return text[:at] + junk + text[at:], f"{junk!r} inserted at byte {at}"
    if choice == 2:
        depth = rng.choice([40, 1000, 5000])
        return text + f"extra: {'[' * depth}{']' * depth}\n", f"nested {depth} deep"
    if choice == 3:
        laughs = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"] + [
            f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
        return "\n".join(laughs) + "\n" + text + "bomb: *a8\n", "an alias bomb"
    if choice == 4:
        first_line = text.splitlines()[0]
        return text + first_line + "\n", f"{first_line!r} given twice"
    if choice == 5:
        return "", "an empty file"
    return "- a list\n- not a mapping\n", "a list at the top level"


def _mutate_data(rng: random.Random, raw: dict, folder: Path) -> str:
    """Point the pipeline at parquet files written here, one of them broken in one way."""
    rows = rng.choice([1, 2, 3, 40, 200])
    x = np.arange(rows, dtype=np.float64)
    columns = {"x": x, "y": x % 7, "label": np.arange(rows) % 2}
    damage = rng.choice(["none", "nan", "inf", "huge", "one-class", "negative-label",
                         "huge-label", "string-label", "float-label", "missing-column",
                         "empty", "not-parquet", "null", "ragged", "unicode-column"])
    if damage == "nan":
        columns["x"] = np.where(x == 0, np.nan, x)
    elif damage == "inf":
        columns["y"] = np.where(x == 0, np.inf, x)
    elif damage == "huge":
        columns["x"] = np.where(x == 0, 1e308, x)
    elif damage == "one-class":
        columns["label"] = np.zeros(rows, np.int64)
    elif damage == "negative-label":
        columns["label"] = np.where(x == 0, -1, columns["label"])
    elif damage == "huge-label":
        columns["label"] = np.where(x == 0, 2**62, columns["label"])
    elif damage == "string-label":
        columns["label"] = pa.array(np.where(columns["label"] == 1, "pos", "neg").tolist(),
                                    rng.choice([pa.string(), pa.large_string()]))
    elif damage == "float-label":
        columns["label"] = columns["label"] + 0.5
    elif damage == "missing-column":
        del columns["y"]
    elif damage == "empty":
        columns = {name: value[:0] for name, value in columns.items()}
    elif damage == "null":
        columns["x"] = pa.array([None if i == 0 else float(i) for i in range(rows)])
    elif damage == "ragged":
        columns["x"] = pa.array([[1.0] * (i % 3) for i in range(rows)])
    elif damage == "unicode-column":
        columns["x"] = ["é名" * (i % 4) for i in range(rows)]
    train = folder / "train.parquet"
    if damage == "not-parquet":
        train.write_bytes(bytes(rng.randrange(256) for _ in range(rng.randint(0, 64))))
    else:
        pq.write_table(pa.table(columns), train)
    data = {"source": "parquet", "path": str(train), "feature_columns": ["x", "y"],
            "label_column": "label", "train_fraction": 0.5}
    if damage == "string-label" and rng.random() < 0.5:
        data["label_names"] = ["neg", "pos"]
    if "validation" in raw.get("data", {}):
        data["validation"] = {**raw["data"]["validation"], "fraction": 0.2}
    raw["data"] = data
    raw["model"] = {"kind": "logistic"} if rng.random() < 0.5 else {"kind": "mlp",
                                                                   "hidden_sizes": [8]}
    if raw["privacy"].get("mechanism") == "lsg" and raw["model"]["kind"] == "logistic":
        raw["model"] = {"kind": "mlp", "hidden_sizes": [8]}
    return f"{rows} rows, {damage}"


LONG = ["n" * 201, "n" * 250, "n" * 256, "n" * 300, "é" * 128]  # the last: 256 bytes


def _mutate_names(rng: random.Random, raw: dict, folder: Path) -> str:
    """A name or path over what a file system holds (255 bytes a name), or a data path that
    is no file: a FIFO, a directory, a device."""
    import os

    choice = rng.choice(["name", "budget", "data", "output_dir", "ledger", "fifo", "directory",
                         "device"])
    long = rng.choice(LONG)
    if choice == "name":
        raw["name"] = long
    elif choice == "budget":
        raw.setdefault("budget", {"epsilon": 5.0, "delta": 1e-5,
                                  "ledger": str(folder / "ledger")})["name"] = long
    elif choice == "output_dir":
        raw["run"]["output_dir"] = str(folder / long / "runs")
    elif choice == "ledger":
        raw.setdefault("budget", {"name": "b", "epsilon": 5.0, "delta": 1e-5})
        raw["budget"]["ledger"] = str(folder / long)
    else:
        _mutate_data(random.Random(0), raw, folder)  # a good file, then another path
        fifo = folder / "fifo.parquet"
        if choice == "fifo" and not fifo.exists():
            os.mkfifo(fifo)
        raw["data"]["path"] = {"data": str(folder / long / "train.parquet"), "fifo": str(fifo),
                               "directory": str(folder), "device": "/dev/zero"}[choice]
    return f"{choice}: {long[:8]}... ({len(long.encode())} bytes)"


@dataclass
class Outcome:
    code: int | None  # the exit code; None if it raised or timed out
    seconds: float
    output: str
    problem: str = ""  # why the outcome breaks the rules, "" if it keeps them


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout


def run_validate(case: Case) -> Outcome:
    """`raydp-train validate` in this process, its output captured, stopped after SECONDS."""
    return _run_cli(["validate", str(case.pipeline)], SECONDS)


RUN_SECONDS = 300  # a hang guard for `run` of a case (its runs take seconds)


def run_training(case: Case) -> Outcome:
    """`raydp-train run` of the case, one epoch, in this process (on the session's Ray)."""
    outcome = _run_cli(["run", str(case.pipeline), "--set", "training.epochs=1"], RUN_SECONDS)
    if not outcome.problem and outcome.code == 2:
        outcome.problem = _charged_or_kept(case)
    return outcome


def _charged_or_kept(case: Case) -> str:
    """A refused run must reserve nothing and keep no run directory."""
    from raydp_train.budget.ledger import LedgerError
    from raydp_train.budget.ledger_reading import ledger_rows

    raw = yaml.safe_load(case.pipeline.read_text())
    name = ((raw.get("budget") or {}) if isinstance(raw, dict) else {}).get("name")
    try:
        rows = ledger_rows(str(name), str(case.folder / "ledger")) if name else []
    except (LedgerError, OSError):
        rows = []  # no ledger (or none readable): nothing was reserved in it
    if any(row["kind"] == "reserve" for row in rows):
        return "a refused run reserved budget"
    if list((case.folder / "runs").glob("*/pipeline.yaml")):
        return "a refused run kept a run directory"
    return ""


def _run_cli(argv: list[str], seconds: int) -> Outcome:
    import torch  # noqa: F401 -- before the alarm: see below

    from raydp_train.commands.cli import main

    # torch is imported before any case's alarm is armed: its cold import alone can take over
    # SECONDS on a loaded 2-core machine, and an alarm inside it leaves a half-imported torch
    # that fails every later case ("module 'torch' has no attribute 'cuda'").
    output = io.StringIO()
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(seconds)
    started = time.monotonic()
    code = None
    try:
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            code = main(argv)
    except _Timeout:
        output.write(f"\n<stopped after {seconds} s>")
    except BaseException:  # noqa: BLE001 (anything escaping main is what the fuzz looks for)
        output.write(traceback.format_exc())
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    outcome = Outcome(code, time.monotonic() - started, output.getvalue())
    outcome.problem = check_outcome(outcome)
    return outcome


def check_outcome(outcome: Outcome) -> str:
    """The rules: exit 0, or exit 2/3 with an `error:` line naming the problem (more lines
    only for more problems, each indented); never a traceback; within SECONDS."""
    if outcome.code is None:
        return "no exit code: raised or hung"
    if "Traceback" in outcome.output:
        return "a traceback in the output"
    if outcome.code == 0:
        return ""
    if outcome.code not in (2, 3):
        return f"exit {outcome.code}"
    lines = [line for line in outcome.output.splitlines() if line.strip()]
    if outcome.code == 3:  # validate's plan ending with the budget's refusal, or a run's stop
        refusal = ("CANNOT BE PAID", "STOPPED")
        return "" if any(line.startswith(refusal) for line in lines) else "no refusal line"
    errors = [i for i, line in enumerate(lines) if line.startswith("error:")]
    if len(errors) != 1:
        return f"{len(errors)} error lines"
    after = lines[errors[0] + 1:]
    if any(not line.startswith("  ") for line in after):
        return "more than the error after the error line"
    return ""


def summary(results: list[tuple[Case, Outcome]]) -> dict:
    codes = {}
    for _, outcome in results:
        codes[str(outcome.code)] = codes.get(str(outcome.code), 0) + 1
    return {"cases": len(results), "exit_codes": codes,
            "broken": [{"case": case.number, "what": case.description,
                        "problem": outcome.problem, "output": outcome.output[-1500:]}
                       for case, outcome in results if outcome.problem],
            "slowest_s": round(max(outcome.seconds for _, outcome in results), 2)}


def as_json(value) -> str:
    return json.dumps(value, indent=2, default=str)
