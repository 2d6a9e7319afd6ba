"""The configurations a sweep's search algorithm draws, by Ray Tune's own generator without
running a trial (no Ray needed): the oracle for what a seeded sweep must run."""

from raydp_train.sweeps.search import param_space, search_algorithm


def drawn(pipeline, score: float = 0.5) -> list[dict]:
    """Every configuration, in the order drawn, each trial finishing (with `score`, for an
    adaptive search to learn from) before the next."""
    from ray.tune.experiment import Experiment
    from ray.tune.search import SearchAlgorithm, SearchGenerator

    config = pipeline.tune
    search = search_algorithm(pipeline)
    if not isinstance(search, SearchAlgorithm):  # an adaptive Searcher: as the Tuner wraps it
        search = SearchGenerator(search)
        search.set_search_properties(config.metric, config.mode, param_space(config))
    search.add_configurations([Experiment("drawn", run=lambda config: None,
                                          config=param_space(config),
                                          num_samples=config.num_samples)])
    configs = []
    while (trial := search.next_trial()) is not None:
        configs.append(trial.config)
        search.on_trial_complete(trial.trial_id, {config.metric: score})
    return configs
