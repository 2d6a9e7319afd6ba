"""The plots of a run and of a sweep. Each is built as a matplotlib Figure (tests read its
lines and legend) and saved as a PNG; legends sit below the axes, never over the data."""

from __future__ import annotations

import functools
import math
from pathlib import Path

from raydp_train.train.stops import StopReason

ACCURACIES = (("test_accuracy", "test accuracy"), ("validation_accuracy", "validation accuracy"))
# Record key -> (legend text, line style, colour) of what an accuracy must beat.
BASELINES = {"chance": ("chance (1/K)", ":", "gray"),
             "test_majority_class": ("majority class of the test split", "--", "black")}
# A sweep trial's stop reason -> its marker.
TRIAL_MARKERS = {StopReason.COMPLETED.value: "o", StopReason.BUDGET_EXHAUSTED.value: "x",
                 StopReason.STOPPED_BY_SCHEDULER.value: "s"}
ACCURACY_LABEL = "accuracy (fraction correct)"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def run_figures(record: dict) -> dict:
    """{PNG name: figure} of a run record. Epsilon plots only for a private run (a
    non-private one has epsilon infinite)."""
    privacy = record["privacy"]
    spent = f"epsilon spent (delta={privacy['delta']:g}, {privacy['accountant'].upper()})"
    drawn, figure_of = _drawn(record["metrics"])
    figures = {f"{drawn}_vs_epoch.png": figure_of(record, "epoch", "epoch")}
    if privacy.get("private", True):
        figures[f"{drawn}_vs_epsilon.png"] = figure_of(record, "epsilon", spent)
        figures["epsilon_vs_steps.png"] = _epsilon_figure(record, spent)
    return figures


def accuracy_figure(record: dict, x: str, xlabel: str):
    """Test (and validation) accuracy after each epoch against `x` (a metrics column), with the
    baselines the run recorded."""
    figure, axes = _pyplot().subplots(figsize=(7, 4.8))
    values = []
    for column, label in ACCURACIES:
        rows = [row for row in record["metrics"] if row.get(column) is not None]
        if rows:
            values += [row[column] for row in rows]
            axes.plot([row[x] for row in rows], [row[column] for row in rows], marker="o",
                      label=label)
    _baseline_lines(axes, record.get("baselines", {}))
    _accuracy_limits(axes, values)
    if x == "epsilon":
        axes.set_xlim(left=0)  # from nothing spent
    axes.set(xlabel=xlabel, ylabel=ACCURACY_LABEL,
             title=f"{record['pipeline']['name']}: accuracy after each epoch, by {x}")
    return _finished(figure, axes)


# What a run without test accuracy draws: metrics column -> (name, y-axis label).
LOWER_IS_BETTER = {"test_perplexity": ("perplexity", "perplexity per token (lower is better)"),
                   "test_mse": ("mse", "mean squared error (lower is better)")}


def _drawn(metrics: list[dict]):
    """(name, figure function) of what a run's metrics hold: accuracy, else a causal LM's
    perplexity or a regression's mean squared error."""
    for column, (name, ylabel) in LOWER_IS_BETTER.items():
        if any(column in row for row in metrics):
            return name, functools.partial(lower_is_better_figure, column=column, name=name,
                                           ylabel=ylabel)
    return "accuracy", accuracy_figure


def lower_is_better_figure(record: dict, x: str, xlabel: str, column: str, name: str,
                           ylabel: str):
    """A held-out `column` (a causal LM's perplexity, a regression's mse) after each epoch
    against `x` (a metrics column), with the run's baselines of it."""
    figure, axes = _pyplot().subplots(figsize=(7, 4.8))
    rows = record["metrics"]
    axes.plot([row[x] for row in rows], [row[column] for row in rows], marker="o",
              label=column.replace("_", " "))
    mean_mse = record.get("baselines", {}).get("test_mean_prediction_mse")
    if column == "test_mse" and mean_mse is not None:
        axes.axhline(mean_mse, color="black", linestyle="--", linewidth=1.2,
                     label=f"predicting the test mean: {mean_mse:.3f}")
    if x == "epsilon":
        axes.set_xlim(left=0)
    axes.set(xlabel=xlabel, ylabel=ylabel,
             title=f"{record['pipeline']['name']}: {name} after each epoch, by {x}")
    return _finished(figure, axes)


def _epsilon_figure(record: dict, spent: str):
    figure, axes = _pyplot().subplots(figsize=(7, 4.8))
    metrics = record["metrics"]
    axes.plot([r["steps_charged"] for r in metrics], [r["epsilon"] for r in metrics],
              marker="o")
    axes.set(xlabel="DP steps charged (restarts included)", ylabel=spent,
             title=f"{record['pipeline']['name']}: privacy spent, after each epoch")
    return _finished(figure, axes)


def privacy_utility_figure(trials: list[dict], metric: str, title: str, best: dict | None,
                           privacy: dict, chance: float | None = None):
    """One point per trial (its final `metric` against the epsilon it spent), labelled with its
    trial number; the best trial starred; the global budget's epsilon and what the whole sweep
    spent (`privacy`: the sweep's statement) as vertical lines."""
    figure, axes = _pyplot().subplots(figsize=(7.5, 5))
    shown = [t for t in trials if t["stop_reason"] in TRIAL_MARKERS and _finite(t[metric])]
    for stop, marker in TRIAL_MARKERS.items():
        points = [t for t in shown if t["stop_reason"] == stop]
        if points:
            axes.scatter([t["epsilon"] for t in points], [t[metric] for t in points],
                         marker=marker, label=f"trial: {stop}")
    _label_trials(axes, shown, metric, max([privacy["budget_epsilon"],
                                            *(t["epsilon"] for t in shown)]))
    if best is not None:
        axes.scatter([best["epsilon"]], [best[metric]], marker="*", s=320, facecolors="none",
                     edgecolors="crimson", linewidths=1.5,
                     label=f"best: trial {trial_number(best['trial'])}")
    axes.axvline(privacy["budget_epsilon"], color="crimson", linewidth=1.2,
                 label=f"global budget: epsilon {privacy['budget_epsilon']:g}")
    if _finite(privacy.get("epsilon")):
        axes.axvline(privacy["epsilon"], color="crimson", linestyle="--", linewidth=1,
                     label=f"the whole sweep spent: epsilon {privacy['epsilon']:.3f}")
    _baseline_lines(axes, {"chance": chance})
    _accuracy_limits(axes, [t[metric] for t in shown])
    axes.set_xlim(left=0)
    axes.set(xlabel=f"epsilon spent by the trial (delta={privacy['delta']:g}, "
                    f"{privacy['accountant'].upper()})",
             ylabel=f"{metric} (fraction correct)",
             title=f"{title}: {metric} vs privacy, one point per trial (its number)")
    return _finished(figure, axes)


def _label_trials(axes, trials: list[dict], metric: str, widest_epsilon: float) -> None:
    """Each trial's number beside its point; trials that would be drawn on one spot (same
    settings of a searched sigma, say) share one label, "1, 2", instead of overprinting."""
    spots: dict[tuple[int, int], list[dict]] = {}
    for trial in trials:
        spot = (round(60 * trial["epsilon"] / widest_epsilon), round(60 * trial[metric]))
        spots.setdefault(spot, []).append(trial)
    for group in spots.values():
        axes.annotate(", ".join(trial_number(t["trial"]) for t in group),
                      (group[0]["epsilon"], group[0][metric]), textcoords="offset points",
                      xytext=(6, 4), fontsize=8)


def trial_number(trial_id: str) -> str:
    """`3f2c1_00004` -> `4`: Ray Tune numbers a sweep's trials after the underscore."""
    number = trial_id.rpartition("_")[2]
    return str(int(number)) if number.isdigit() else trial_id


def save(figure, path: Path) -> Path:
    figure.savefig(path, dpi=100)
    _pyplot().close(figure)
    return path


def _baseline_lines(axes, baselines: dict) -> None:
    for key, (label, style, colour) in BASELINES.items():
        if baselines.get(key) is not None:
            axes.axhline(baselines[key], color=colour, linestyle=style, linewidth=1.2,
                         label=f"{label}: {baselines[key]:.3f}")


def _accuracy_limits(axes, values: list[float]) -> None:
    """0 to 1, widened for a noisy released accuracy that falls outside."""
    axes.set_ylim(min([0.0, *values]) - 0.02, max([1.0, *values]) + 0.02)


def _finished(figure, axes):
    axes.grid(alpha=0.3)
    if axes.get_legend_handles_labels()[0]:
        axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=8,
                    frameon=False)
    figure.tight_layout()
    return figure


def _finite(value) -> bool:
    return value is not None and not math.isnan(value)
