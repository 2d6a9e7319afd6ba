"""What a sweep prints while it runs (`sweeps/runner.py`), as Tune's own reporter would: a line
per trial epoch and per finished trial, and a table of the whole sweep at each trial's end
and every `TABLE_EVERY_S` seconds: trials running and finished, the best released metric so
far, and the epsilon the budget has counted and has left. Never under random stopping, which
releases the best trial alone."""

from __future__ import annotations

import math
import time

TABLE_EVERY_S = 30.0


def progress_printer(on_line, pipeline, budget):
    """Tune's callback that prints, on the driver, what the sweep's trials have released."""
    from ray.tune import Callback

    metric = pipeline.tune.metric
    # "epoch 3/20", unless the trials differ in epochs
    of = "" if "training.epochs" in pipeline.tune.search_space else f"/{pipeline.training.epochs}"
    pick = max if pipeline.tune.mode == "max" else min

    class ProgressPrinter(Callback):
        def __init__(self):
            self.shown: dict[str, int] = {}  # each trial's last epoch shown
            self.scores: dict[str, float] = {}  # each trial's best released metric
            self.table_at = time.monotonic()

        def on_trial_result(self, iteration, trials, trial, result, **info):
            # A trial's last epoch arrives in its final report (run_trial).
            score = result.get(metric, math.nan)
            if not math.isnan(score):
                self.scores[trial.trial_id] = pick(score, self.scores.get(trial.trial_id, score))
            if result.get("epoch", 0) > self.shown.get(trial.trial_id, 0) and "epsilon" in result:
                self.shown[trial.trial_id] = result["epoch"]
                on_line(f"  {trial.trial_id}  epoch {result['epoch']}{of}  {metric} "
                        f"{score:.4f}  epsilon {result['epsilon']:.3f}")
            if result.get("final"):
                on_line(f"  {trial.trial_id}  {result['stop']}  "
                        f"(trial epsilon {result['epsilon']:.3f})")
                self.table(trials)

        def on_step_end(self, iteration, trials, **info):
            if time.monotonic() - self.table_at >= TABLE_EVERY_S:
                self.table(trials)

        def table(self, trials) -> None:
            self.table_at = time.monotonic()
            on_line(sweep_table(trials, self.scores, metric, pick, budget.status()))

    return ProgressPrinter()


def sweep_table(trials, scores: dict[str, float], metric: str, pick, status: dict) -> str:
    """One line for the sweep so far: its trials by state, the best metric released, and the
    budget's epsilon counted and left (every run and sweep on it counted)."""
    states = [trial.status for trial in trials]
    running, pending = states.count("RUNNING"), states.count("PENDING")
    finished = len(states) - running - pending - states.count("PAUSED")
    best = f"{pick(scores.values()):.4f}" if scores else "none yet"
    left = max(0.0, status["epsilon"] - status["epsilon_counted"])
    return (f"sweep: {running} running, {finished} finished, {pending} pending; best {metric} "
            f"{best}; budget epsilon {status['epsilon_counted']:.3f} counted, {left:.3f} left "
            f"of {status['epsilon']:g}")
