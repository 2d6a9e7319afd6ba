"""What a random-stopping sweep releases (ARCHITECTURE.md §2.7): the best trial alone.

Papernot & Steinke's bound (dp-accounting's RepeatAndSelectDpEvent) covers the outputs of
the best trial and nothing else: not how many trials ran, nor any other trial's releases. So
the sweep keeps the best trial's row and model, under a name that does not count the trials,
and removes what Ray Tune wrote of every trial: its records in the sweep directory, each
trial's run folders (`train/`), and Tune's staging copy in the Ray session folder."""

from __future__ import annotations

import shutil
from pathlib import Path

BEST = "best"  # the released trial's name
TUNE_RECORDS = "trials"  # Tune's experiment, in the sweep directory and in its staging
TRIAL_RUNS = "train"  # each trial's run folders: its charges, release log, checkpoints


def best_alone(directory: Path, trials: list[dict], best: dict | None, models: str,
               result_grid, on_line) -> list[dict]:
    """The rows to release: the best trial's, renamed (its model too, in `models`); every
    trace of the others removed. A failed trial's error is the user's to act on: it is
    printed, naming no trial."""
    if result_grid is not None:
        _remove_tune_staging({Path(result.path).name for result in result_grid})
    for written in (TUNE_RECORDS, TRIAL_RUNS):
        shutil.rmtree(directory / written, ignore_errors=True)
    for error in dict.fromkeys(t["error"] for t in trials if "error" in t):
        on_line(f"a trial failed: {error}")
    if best is None:
        return []
    saved = directory / models / best["trial"]
    if best["trial"] and saved.is_dir():
        saved.rename(directory / models / BEST)
    return [{**best, "trial": BEST}]


def _remove_tune_staging(trial_folders: set[str]) -> None:
    """Tune stages each trial's results (result.json, progress.csv, the experiment's state)
    in the driver's Ray session folder, <session>/artifacts/<time>/trials/, before copying
    them to the sweep directory; this sweep's is the one holding its trials' folders."""
    import ray

    if not ray.is_initialized():  # ray.init below would start one, with nothing of ours
        return
    context = ray.init(ignore_reinit_error=True)  # connected already: its session, nothing new
    session = getattr(context, "address_info", {}).get("session_dir")
    for staged in Path(session).glob(f"artifacts/*/{TUNE_RECORDS}") if session else ():
        if trial_folders & {path.name for path in (staged / "driver_artifacts").iterdir()}:
            shutil.rmtree(staged, ignore_errors=True)
