"""The configurations a sweep's sampler draws, by Ray Tune's own generator without running a
trial (no Ray needed): the oracle for what a seeded sweep must run."""

from raydp_train.sweeps.runner import param_space, sampler


def drawn(pipeline) -> list[dict]:
    """Every configuration, in the order drawn, each trial finishing before the next."""
    from ray.tune.experiment import Experiment

    search = sampler(pipeline)
    search.add_configurations([Experiment("drawn", run=lambda config: None,
                                          config=param_space(pipeline.tune),
                                          num_samples=pipeline.tune.num_samples)])
    configs = []
    while (trial := search.next_trial()) is not None:
        configs.append(trial.config)
        search.on_trial_complete(trial.trial_id)
    return configs
