"""Run records: what a run trained, how, and the privacy it spent (JSON, no training data)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from raydp_train.pipeline import Pipeline
from raydp_train.plan import PrivacyPlan


def new_run_dir(pipeline: Pipeline) -> Path:
    """`<run.output_dir>/<name>-<timestamp>`, never reusing an existing directory."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path(pipeline.run.output_dir) / f"{pipeline.name}-{stamp}"
    run_dir, suffix = base, 1
    while run_dir.exists():
        run_dir, suffix = base.with_name(f"{base.name}-{suffix}"), suffix + 1
    run_dir.mkdir(parents=True)
    return run_dir


def privacy_statement(plan: PrivacyPlan, steps_done: int, noise_mode: str) -> dict:
    """The final (epsilon, delta) claim with everything needed to re-derive it."""
    return {
        "epsilon": plan.epsilon(steps_done),
        "delta": plan.delta,
        "accountant": plan.accountant,
        "epsilon_rdp": plan.epsilon(steps_done, "rdp"),
        "epsilon_pld": plan.epsilon(steps_done, "pld"),
        "rough_epsilon_estimate": plan.rough_epsilon(),
        "sampling_rate": plan.sampling_rate,
        "noise_multiplier": plan.noise_multiplier,
        "noise_calibrated": plan.noise_calibrated,
        "clip_norm": plan.clip_norm,
        "steps": steps_done,
        "expected_batch_size": plan.expected_batch_size,
        "num_examples": plan.num_examples,
        "workers": 1,
        "noise_mode": noise_mode,
        "for_release": noise_mode == "secure",
    }


def write_run_record(
    run_dir: Path, pipeline: Pipeline, metrics: list[dict], privacy: dict, model
) -> Path:
    record = {
        "pipeline": pipeline.model_dump(mode="json"),
        "metrics": metrics,
        "privacy": privacy,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    path = run_dir / "record.json"
    path.write_text(json.dumps(record, indent=2))
    torch.save(model.state_dict(), run_dir / "model.pt")
    return path
