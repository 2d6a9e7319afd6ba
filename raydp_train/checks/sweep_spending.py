"""What a sweep may spend, known before any trial (ARCHITECTURE.md §2.7): the search space
checked at its extremes, the worst trial it allows, the composed trials or random stopping's
one reservation, whether the budget can pay the first of them, and whether the package an
adaptive search needs is installed."""

from __future__ import annotations

import importlib.util
import itertools
import math
import os
from dataclasses import replace

import numpy as np

from raydp_train.accounting.random_stopping import draw_trial_count
from raydp_train.budget.terms import Spend
from raydp_train.checks.preflight import check_pipeline
from raydp_train.config.pipeline import Pipeline, pipeline_from_dict
from raydp_train.config.training import TrainingSetupError

SPEND_FIELDS = ("training.batch_size", "training.epochs")  # with sigma: what a trial spends
EXTRA = "search"  # pyproject.toml's extra with the adaptive searchers' packages
MODULES = {"optuna": "optuna", "hyperopt": "hyperopt", "bayesopt": "bayes_opt"}


def check_search_installed(search: str) -> None:
    """One line naming the extra when an adaptive search's package is missing."""
    module = MODULES.get(search)
    if module is not None and importlib.util.find_spec(module) is None:
        raise TrainingSetupError(
            f"tune.search: {search} needs the {module!r} package, which is not installed: "
            f"pip install 'raydp-train[{EXTRA}]' (or choose search: random)")


def check_search_space(pipeline: Pipeline, plan, checked=None) -> None:
    """Validate the pipeline at every extreme value of every searched field, before any
    budget is touched: a bad bound fails here, naming the field, not in trial 7; and the
    search algorithm's package is installed. `checked`: the summary of the sweep's Ray
    Datasets, checked once (check_pipeline)."""
    check_search_installed(pipeline.tune.search)
    base = pipeline.model_dump(mode="json")
    for key, dimension in pipeline.tune.search_space.items():
        for value in dimension.values():
            candidate = pipeline_from_dict(base, [f"{key}={value}"],
                                           source=f"tune.search_space.{key}={value}")
            # data and weights: checked once
            check_pipeline(candidate, for_training=False, checked=checked)
    _check_warmup_fits(pipeline, plan)


def _check_warmup_fits(pipeline: Pipeline, plan) -> None:
    """The most warmup steps a trial can get fit the trial with the fewest steps: searched
    batch sizes and epochs change the steps, so no one field's extremes show it."""
    searched = pipeline.tune.search_space.get("training.warmup_steps")
    warmup = (max(int(v) for v in searched.values()) if searched
              else pipeline.training.warmup_steps or 0)
    fewest = min(_trial_plan(pipeline, plan, o).steps for o in _spend_candidates(pipeline))
    if warmup > fewest:
        raise TrainingSetupError(
            f"training.warmup_steps: a trial may get {warmup} warmup steps, but the search's "
            f"smallest number of epochs at its largest batch size runs only {fewest} steps; "
            "lower it, or set training.warmup_fraction")


def worst_trial_spend(pipeline: Pipeline, plan) -> Spend:
    """A spend that no trial of the search space exceeds at any RDP order: the largest
    sampling rate, the most steps and releases and the smallest sigma of any trial. Per order,
    a Poisson-subsampled Gaussian never costs less with a larger q, more steps or less noise,
    so this bounds every trial, though no one trial need have all four (ARCHITECTURE.md §2.7).
    Only sigma, `training.batch_size` and `training.epochs` among the searchable fields change
    what a trial spends; a trial's own sigma is calibrated to its (q, steps) when the pipeline
    sets target_epsilon."""
    trials = [_trial_plan(pipeline, plan, overrides) for overrides in _spend_candidates(pipeline)]
    searched = pipeline.tune.search_space.get("privacy.noise_multiplier")
    sigma = (min(searched.values()) if searched is not None
             else min(trial.noise_multiplier for trial in trials))
    return replace(plan.spend(max(t.steps for t in trials),
                              max(t.epochs * t.releases_per_epoch for t in trials)),
                   sampling_rate=max(t.sampling_rate for t in trials), noise_multiplier=sigma)


def _spend_candidates(pipeline: Pipeline) -> list[list[str]]:
    """Every combination of the searched batch sizes and epochs, as `--set` overrides."""
    space = pipeline.tune.search_space
    axes = [[f"{key}={int(v)}" for v in space[key].values()] for key in SPEND_FIELDS
            if key in space]
    return [list(overrides) for overrides in itertools.product(*axes)]


def _trial_plan(pipeline: Pipeline, plan, overrides: list[str]):
    from raydp_train.train.plan import make_plan

    if not overrides:
        return plan
    candidate = pipeline_from_dict(pipeline.model_dump(mode="json"), overrides,
                                   source=f"tune.search_space {overrides}")
    return make_plan(candidate, plan.num_examples)


def random_stopping_spend(pipeline: Pipeline, plan) -> Spend:
    """The whole random-stopping sweep as one reservation: RepeatAndSelect of the costliest
    trial."""
    stopping = pipeline.tune.random_stopping
    return replace(worst_trial_spend(pipeline, plan), mean_trials=stopping.mean_trials,
                   shape=stopping.shape_value)


def first_refusal(pipeline: Pipeline, plan) -> str:
    """Why the budget, as its ledger has it now, cannot pay the sweep's first (costliest)
    trial, or the random-stopping sweep's one reservation; "" when it can. Trials still
    reserve for themselves: this only spares a spent budget a sweep that cannot train."""
    from raydp_train.budget.ledger_reading import book_of

    first = (random_stopping_spend(pipeline, plan) if pipeline.tune.selection == "random_stopping"
             else trials_spend(pipeline, plan, 1))
    book = book_of(pipeline.budget, pipeline.run.output_dir, pipeline.privacy.unit)
    decision, _, _ = book.propose("preflight", "first trial", first)
    return "" if decision.granted else decision.reason


def trial_count(config) -> int:
    """Trials a composition sweep runs: num_samples per point of the grid."""
    grids = [len(d.grid) for d in config.search_space.values() if d.grid is not None]
    return config.num_samples * math.prod(grids)


def trials_spend(pipeline: Pipeline, plan, trials: int) -> Spend:
    """`trials` costliest trials, composed: the same (q, sigma) steps and releases add up."""
    worst = worst_trial_spend(pipeline, plan)
    return replace(worst, steps=worst.steps * trials, releases=worst.releases * trials)


def draw_trial_count_of(pipeline: Pipeline) -> int:
    """K for random stopping, seeded from os.urandom unless the run is seeded (not for release)."""
    seed = pipeline.run.seed
    rng = np.random.default_rng(int.from_bytes(os.urandom(16), "little") if seed is None else seed)
    stopping = pipeline.tune.random_stopping
    return draw_trial_count(stopping.mean_trials, stopping.shape_value, rng)
