"""A sweep's outputs: the result table, the best configuration, the privacy-utility plot and
the privacy statement of the whole sweep."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq

from raydp_train.data.targets import ClassIds, label_kind
from raydp_train.reports.plots import privacy_utility_figure, save


def write_sweep_outputs(sweep, pipeline, on_line) -> None:
    directory, config = sweep.directory, pipeline.tune
    if sweep.trials:
        pq.write_table(pa.Table.from_pylist(sweep.trials), directory / "results.parquet")
    (directory / "sweep.json").write_text(json.dumps(
        {"directory": str(directory), "trials": sweep.trials, "best": sweep.best,
         "privacy": sweep.privacy}, indent=2,
        default=str))
    # Chance (1/K) is a class-id classifier's; an exact match of K labels has none so simple.
    chance = 1 / sweep.num_classes if isinstance(label_kind(pipeline.data), ClassIds) else None
    figure = privacy_utility_figure(sweep.trials, config.metric, pipeline.name, sweep.best,
                                    sweep.privacy, chance)
    plot = save(figure, directory / "privacy_utility.png")
    on_line(results_table(sweep.trials, list(config.search_space), config.metric))
    if sweep.best is not None:
        chosen = ", ".join(f"{k}={sweep.best[k]:.6g}" for k in config.search_space)
        model = (f"{sweep.best['model']} (already trained: no need to run it again)"
                 if sweep.best["model"] else "none kept (the scheduler stopped this trial "
                 "part-way; running best.yaml trains it)")
        on_line(f"\nbest ({config.metric} {sweep.best[config.metric]:.4f}): {chosen}"
                f"\nbest model: {model}\nbest pipeline: {directory / 'best.yaml'} (running it "
                "spends again)")
    on_line(privacy_text(sweep.privacy))
    on_line(f"wrote {directory / 'results.parquet'}, {plot}, {directory / 'sweep.json'}")


def results_table(trials: list[dict], params: list[str], metric: str) -> str:
    columns = ["trial", *params, "epochs", "epsilon", metric, "stop_reason"]
    widths = [max(len(c), 12) for c in columns]
    lines = ["  ".join(f"{c:<{w}}" for c, w in zip(columns, widths, strict=True))]
    for trial in trials:
        cells = []
        for column, width in zip(columns, widths, strict=True):
            value = trial.get(column, "")
            text = f"{value:.4g}" if isinstance(value, float) else str(value)
            cells.append(f"{text:<{width}}")
        lines.append("  ".join(cells))
    return "\n".join(lines)


def privacy_text(privacy: dict) -> str:
    how = ("composition of every trial's events" if privacy["selection"] == "composition"
           else "random stopping (Papernot & Steinke): the best trial alone released, the "
                "number of trials kept secret")
    return (f"\nprivacy of the whole sweep: epsilon {privacy['epsilon']:.4f} at delta "
            f"{privacy['delta']:g} ({privacy['accountant'].upper()}, {how})\n"
            f"budget '{privacy['budget']}': epsilon {privacy['budget_epsilon_counted']:.4f} of "
            f"{privacy['budget_epsilon']:g} counted in all (ledger {privacy.get('ledger')})")


def best_yaml_header(directory, best: dict, pipeline) -> str:
    """best.yaml must not send anyone to train, and spend, again for a model they have."""
    model = (f"Its model is already saved: {best['model']} (model.pt, record.json)"
             if best["model"] else "Its model was not kept: the scheduler stopped it part-way")
    return (f"# The best trial ({pipeline.tune.metric} {best[pipeline.tune.metric]:.4f}) of the "
            f"sweep in {directory}.\n# {model}.\n# `raydp-train run` of this file trains a NEW "
            f"model and SPENDS AGAIN from budget '{pipeline.budget.name}'\n# (`raydp-train "
            "validate` says whether the budget can still pay).\n")
