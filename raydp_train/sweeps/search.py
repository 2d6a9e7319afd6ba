"""Which configuration each trial of a sweep runs (`tune.search`), through Ray Tune's own search
algorithms, seeded by `run.seed`; and
which trials Tune stops or changes on the way (`tune.scheduler`).

`random` and `grid` draw every trial up front (Tune's BasicVariantGenerator); `optuna`,
`hyperopt` and `bayesopt` choose each trial from the released validation metric of the trials
before it. Under composition accounting that is covered: every trial's steps and noisy
releases are composed, whatever chose them (ARCHITECTURE.md §2.7). Random stopping's theorem
covers independent draws only, so the schema allows it `random` alone.
"""

from __future__ import annotations

import math

from raydp_train.checks.sweep_spending import check_search_installed
from raydp_train.config.pipeline import Pipeline
from raydp_train.config.tune import PLAN_FIELDS, WHOLE_NUMBERS


def search_algorithm(pipeline: Pipeline):
    """Tune's search algorithm of the sweep, at most `tune.max_concurrent_trials` trials at
    once. With `run.seed` it draws the same configurations (given the same results, for the
    adaptive ones) on every run of the sweep; without, new ones each time."""
    config, seed = pipeline.tune, pipeline.run.seed
    check_search_installed(config.search)
    if config.search in ("random", "grid"):
        from ray.tune.search.basic_variant import BasicVariantGenerator

        # The limit goes here: TuneConfig's max_concurrent_trials is ignored beside a search_alg.
        return BasicVariantGenerator(max_concurrent=config.max_concurrent_trials,
                                     random_state=seed)
    return _skipping_unscored(_adaptive(config.search, config.metric, config.mode, seed),
                              config.max_concurrent_trials)


def _adaptive(search: str, metric: str, mode: str, seed: int | None):
    if search == "optuna":
        from ray.tune.search.optuna import OptunaSearch

        return OptunaSearch(metric=metric, mode=mode, seed=seed)
    if search == "hyperopt":
        from ray.tune.search.hyperopt import HyperOptSearch

        return HyperOptSearch(metric=metric, mode=mode, random_state_seed=seed)
    from ray.tune.search.bayesopt import BayesOptSearch

    return BayesOptSearch(metric=metric, mode=mode, random_state=seed, verbose=0)


def _skipping_unscored(searcher, max_concurrent: int):
    """`searcher` behind Tune's ConcurrencyLimiter, never learning from a trial that released
    no metric (the budget stopped it before its first epoch): it is told the trial failed, as
    a NaN would break bayesopt's Gaussian process."""
    from ray.tune.search import ConcurrencyLimiter

    class SkipsUnscored(ConcurrencyLimiter):
        def on_trial_complete(self, trial_id, result=None, error=False):
            score = (result or {}).get(self._metric, math.nan)
            unscored = not isinstance(score, (int, float)) or math.isnan(score)
            super().on_trial_complete(trial_id, result, error or unscored)

    return SkipsUnscored(searcher, max_concurrent=max_concurrent)


def scheduler(pipeline: Pipeline):
    """Tune's trial scheduler: FIFO, ASHA (stops trials behind at each rung), or PBT (a trial
    behind continues from a trial ahead's checkpoint, its settings mutated: every searched
    field but those that set what it spends)."""
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, PopulationBasedTraining


    config = pipeline.tune
    if config.scheduler == "fifo":
        return FIFOScheduler()
    if config.scheduler == "asha":
        return ASHAScheduler(
            time_attr="epoch", metric=config.metric, mode=config.mode,
            max_t=most_epochs(pipeline), grace_period=config.asha.grace_period,
            reduction_factor=config.asha.reduction_factor)
    # Listed values mutate to a neighbour; ranges by a factor of 0.8 or 1.2 (or resampled).
    mutations = {key: _listed(entry) for key, entry in param_space(config).items()
                 if key not in PLAN_FIELDS}
    return PopulationBasedTraining(
        time_attr="epoch", metric=config.metric, mode=config.mode,
        perturbation_interval=config.pbt.perturbation_interval,
        quantile_fraction=config.pbt.quantile_fraction, hyperparam_mutations=mutations,
        synch=config.pbt.synch)


def _listed(entry):
    """A search-space entry as PBT mutates it: the values of a choice or grid, else the range."""
    if isinstance(entry, dict):
        return entry["grid_search"]
    return getattr(entry, "categories", entry)


def param_space(config) -> dict:
    from ray import tune

    make = {"choice": tune.choice, "grid": tune.grid_search,
            "uniform": lambda b: tune.uniform(*b), "loguniform": lambda b: tune.loguniform(*b)}
    return {key: make[d.kind]([int(v) for v in d.values()] if key in WHOLE_NUMBERS
                              else getattr(d, d.kind))
            for key, d in config.search_space.items()}


def most_epochs(pipeline: Pipeline) -> int:
    """The most epochs any trial runs."""
    searched = pipeline.tune.search_space.get("training.epochs")
    return max(int(v) for v in searched.values()) if searched else pipeline.training.epochs
