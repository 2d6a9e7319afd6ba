"""The `budget`, `tune` and `data.validation` sections: every rule refused with its field path,
and the random-stopping reservation checked against dp-accounting directly. No Ray."""

import dp_accounting
import pytest
from dp_accounting import rdp
from sweep_draws import drawn

from raydp_train.checks.preflight import check_pipeline
from raydp_train.checks.sweep_spending import random_stopping_spend, worst_trial_spend
from raydp_train.config.pipeline import PipelineError, load_pipeline
from raydp_train.errors import UserError
from raydp_train.sweeps.search import search_algorithm

SWEEP = "pipelines/sweep_digits.yaml"


def _error(*overrides: str) -> str:
    with pytest.raises(PipelineError) as caught:
        load_pipeline(SWEEP, overrides)
    return str(caught.value)


@pytest.mark.parametrize(("overrides", "expected"), [
    (["budget=null"], "budget: a sweep spends from one global budget"),
    (["data.validation=null"], "tune.metric: tune.metric validation_accuracy needs data.validation"),
    (["data.validation.noise_multiplier=null"],
     "tune.metric: the sweep would select on private validation rows"),
    (["tune.search_space={training.lr: {choice: [0.1], step: 2}}"],
     "tune.search_space.training.lr.step: unknown field; allowed fields: choice, grid, uniform"),
    (["tune.search_space={training.max_physical_batch: {choice: [2]}}"],
     "cannot search 'training.max_physical_batch'; searchable: privacy.noise_multiplier"),
    (["tune.search_space={training.batch_size: {uniform: [64, 256]}}"],
     ("tune.search_space.training.batch_size: training.batch_size is a whole number: list its "
     "values with choice or grid, not uniform")),
    (["tune.search_space={training.epochs: {choice: [2, 2.5]}}"],
     "tune.search_space.training.epochs.choice: training.epochs is a whole number, got [2.5]"),
    (["tune.search_space={training.lr: {uniform: [0.1, 0.01]}}"],
     "tune.search_space.training.lr.uniform: must be [low, high] with low < high"),
    (["tune.search_space={training.lr: {loguniform: [0.0, 0.1]}}"],
     "tune.search_space.training.lr.loguniform: must be [low, high] with 0 < low < high"),
    (["tune.search_space={training.lr: {choice: [0.1], grid: [0.2]}}"],
     "set exactly one of choice, grid, uniform, loguniform (got choice, grid)"),
    (["tune.search_space={privacy.lsg.rank: {choice: [4]}}"],
     "searching privacy.lsg fields needs privacy.mechanism: lsg"),
    (["privacy.noise_multiplier=null", "privacy.target_epsilon=3"],
     "searching privacy.noise_multiplier needs privacy.noise_multiplier set"),
    (["tune.selection=random_stopping"], "tune.random_stopping: required with selection"),
    (["tune.random_stopping={mean_trials: 4}"], "only allowed with selection: random_stopping"),
    (["tune.selection=random_stopping", "tune.random_stopping={mean_trials: 4}",
      "tune.scheduler=asha"], "tune.scheduler: random_stopping needs independent trials"),
    (["tune.selection=random_stopping", "tune.random_stopping={mean_trials: 4}",
      "budget.accountant=pld"], "tune.selection: random_stopping is accounted with RDP only"),
    (["tune.selection=random_stopping", "tune.random_stopping={mean_trials: 4}",
      "tune.search_space={training.lr: {grid: [0.1, 0.2]}}"],
     "tune.search_space.training.lr: random_stopping draws every trial at random"),
    (["tune.selection=random_stopping", "tune.random_stopping={mean_trials: 4}",
      "run.loggers=[csv]"], "run.loggers: random_stopping releases the best trial alone"),
    (["tune.search=grid"], ("tune.search_space.privacy.noise_multiplier: search: grid crosses "
                            "listed values: give privacy.noise_multiplier grid values, not choice")),
    (["tune.search=optuna", "tune.search_space={training.lr: {grid: [0.1, 0.2]}}"],
     "tune.search_space.training.lr: search: optuna draws from distributions, not a grid"),
    (["tune.search=bayesopt"], ("tune.search_space.privacy.noise_multiplier: search: bayesopt "
                                "models continuous ranges on a linear scale: use uniform, not choice")),
    (["tune.search=tpe"], "tune.search: must be one of 'random', 'grid', 'optuna', 'hyperopt', 'bayesopt', got 'tpe'"),
    (["tune.selection=random_stopping", "tune.random_stopping={mean_trials: 4}",
      "tune.search=hyperopt"], ("tune.search: random_stopping's guarantee (Papernot & Steinke) "
                                "covers trials drawn independently at random; search: hyperopt "
                                "chooses each trial from earlier trials' results (adaptive "
                                "choices are not covered): use search: random, or selection: "
                                "composition")),
    (["tune.scheduler=pbt", "tune.search=optuna"],
     ("tune.scheduler: scheduler: pbt explores by mutating running trials; it does not take "
     "search: optuna")),
    (["tune.scheduler=pbt", "tune.search_space={privacy.noise_multiplier: {choice: [1, 2]}}"],
     ("tune.scheduler: scheduler: pbt mutates searched fields other than "
     "privacy.noise_multiplier, training.batch_size, training.epochs")),
    (["tune.selection=random_stopping", "tune.random_stopping={mean_trials: 4}",
      "tune.scheduler=pbt"], ("tune.scheduler: random_stopping needs independent trials: use "
                             "scheduler: fifo (pbt stops or changes trials")),
    (["tune.pbt={quantile_fraction: 0.75}"], "tune.pbt.quantile_fraction: must be <= 0.5"),
    (["tune.random_stopping={mean_trials: 0.5}", "tune.selection=random_stopping"],
     "tune.random_stopping.mean_trials: must be >= 1, got 0.5"),
    (["budget.epsilon=0"], "budget.epsilon: must be > 0, got 0"),
    (["budget.name=a/b"], "budget.name: may contain only letters"),
    (["budget.persist_across_jobs=3"], "budget.persist_across_jobs"),
    (["data.validation.fraction=1"], "data.validation.fraction: must be < 1, got 1"),
])
def test_bad_sweep_settings_are_refused_naming_the_field(overrides, expected):
    assert expected in _error(*overrides)


def test_a_uniform_range_may_start_at_zero_where_its_field_allows_it():
    from raydp_train.checks.sweep_spending import check_search_space

    space = "tune.search_space={privacy.lsg.sparsity: {uniform: [0.0, 0.5]}}"
    sparsity = load_pipeline(SWEEP, ["privacy.mechanism=lsg", space])
    check_search_space(sparsity, check_pipeline(sparsity)[1])  # sparsity 0 is valid
    assert sparsity.tune.search_space["privacy.lsg.sparsity"].uniform == (0.0, 0.5)
    sigma = load_pipeline(SWEEP, ["tune.search_space={privacy.noise_multiplier: {uniform: [0.0, 2.0]}}"])
    with pytest.raises(PipelineError, match="privacy.noise_multiplier: must be >= 0.001, got 0"):
        check_search_space(sigma, None)  # sigma 0 is not: the field's own check sees it


def test_noisy_validation_releases_cannot_be_calibrated_to_a_target():
    from raydp_train.train.plan import PlanError

    pipeline = load_pipeline(SWEEP, ["tune=null", "privacy.noise_multiplier=null",
                                     "privacy.target_epsilon=3"])
    with pytest.raises(PlanError, match="privacy.target_epsilon: calibration covers"):
        check_pipeline(pipeline)


def test_validation_rows_are_held_out_of_training():
    pipeline = load_pipeline(SWEEP)
    dataset, plan = check_pipeline(pipeline)
    assert len(dataset.validation_labels) == round(0.2 * 1438)
    assert plan.num_examples == dataset.num_train == 1438 - len(dataset.validation_labels)
    assert plan.release_noise_multiplier == 4.0 and plan.releases_per_epoch == 1
    public = check_pipeline(load_pipeline(SWEEP, ["data.validation.private=false"]))[1]
    assert public.release_noise_multiplier == 0.0  # public rows: nothing to charge


@pytest.mark.parametrize("shape", [0.0, 1.0, 2.5, "inf"])
def test_random_stopping_sweep_costs_repeat_and_select_of_its_worst_trial(shape):
    pipeline = load_pipeline(SWEEP, ["tune.selection=random_stopping",
                                     f"tune.random_stopping={{mean_trials: 5, shape: {shape}}}"])
    _, plan = check_pipeline(pipeline)
    spend = random_stopping_spend(pipeline, plan)
    # The smallest sigma of the search space (choice [1.2, 1.5, 2.0]) bounds every trial.
    trial = dp_accounting.ComposedDpEvent([
        dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
            plan.sampling_rate, dp_accounting.GaussianDpEvent(1.2)), plan.steps),
        dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(4.0), plan.epochs),
    ])
    oracle = rdp.RdpAccountant()
    oracle.compose(dp_accounting.dp_event.RepeatAndSelectDpEvent(trial, 5.0, float(shape)))
    ours = rdp.RdpAccountant()
    ours.compose(spend.dp_event())
    assert ours.get_epsilon(1e-5) == pytest.approx(oracle.get_epsilon(1e-5), rel=1e-12)
    assert spend.noise_multiplier == 1.2 and spend.steps == plan.steps


def test_trial_rows_cover_trials_the_time_budget_never_started():
    from types import SimpleNamespace

    from raydp_train.sweeps.runner import _trial_row

    config = load_pipeline(SWEEP).tune
    never_started = _trial_row(SimpleNamespace(metrics=None, config=None, error=None), config)
    assert never_started["stop_reason"] == "not started"
    assert set(config.search_space) <= set(never_started)  # same columns as the other rows
    finished = _trial_row(SimpleNamespace(
        metrics={"trial_id": "t1", "epoch": 2, "stop": "completed", "stop_reason": "completed",
                 "final": True, "epsilon": 1.5, "steps_charged": 20,
                 "validation_accuracy": 0.8, "test_accuracy": 0.7},
        config={"privacy.noise_multiplier": 2.0}, error=None), config)
    assert finished["stop_reason"] == "completed" and finished["privacy.noise_multiplier"] == 2.0
    refused = _trial_row(SimpleNamespace(metrics={
        "trial_id": "t2", "epoch": 1, "stop": "budget exhausted", "final": True,
        "stop_reason": "budget exhausted: epsilon 3.1 would pass 3"}, config={}, error=None),
        config)
    assert refused["stop_reason"] == "budget exhausted"  # without its long reason
    cut = _trial_row(SimpleNamespace(metrics={"trial_id": "t3", "epoch": 1, "stop": "running"},
                                     config={}, error=None), config)
    assert cut["stop_reason"] == "stopped by scheduler"  # ASHA ended it after an epoch


def test_param_group_fields_are_searchable_by_index():
    groups = "training.param_groups=[{params: ['1.*'], lr: 0.5}]"
    space = ("tune.search_space={'training.param_groups[0].lr': {loguniform: [0.01, 1]}, "
             "training.warmup_fraction: {choice: [0, 0.1]}}")
    pipeline = load_pipeline(SWEEP, [groups, space])
    assert list(pipeline.tune.search_space) == ["training.param_groups[0].lr",
                                                "training.warmup_fraction"]
    trial = load_pipeline(SWEEP, [groups, space, "training.param_groups[0].lr=0.02"])
    assert trial.training.param_groups[0].lr == 0.02  # how a trial applies its value
    decays = "tune.search_space={training.ema_decay: {uniform: [0.5, 0.95]}}"
    averaged = load_pipeline(SWEEP, [decays, "training.ema_decay=0.7"])
    assert averaged.training.ema_decay == 0.7  # a weight average's decay is searched alike
    assert "training.ema_decay" in _error(decays, "training.ema_decay=1.5")
    assert "cannot search 'training.param_groups[0].params'" in _error(
        groups, "tune.search_space={'training.param_groups[0].params': {choice: [1]}}")


def test_run_seed_draws_the_same_sweep_again_and_caps_the_trials_running_at_once():
    seeded = load_pipeline(SWEEP, ["run.seed=7"])
    first = drawn(seeded)
    assert len(first) == 6 and len({c["training.lr"] for c in first}) == 6
    assert drawn(seeded) == first  # the next run of the sweep: the same six trials
    assert drawn(load_pipeline(SWEEP, ["run.seed=8"])) != first
    assert drawn(load_pipeline(SWEEP)) != drawn(load_pipeline(SWEEP))  # no seed: new draws
    # tune.max_concurrent_trials (2): a third trial waits until one of the two finishes.
    search = search_algorithm(seeded)
    from ray.tune.experiment import Experiment

    search.add_configurations([Experiment("capped", run=lambda config: None, num_samples=6)])
    assert search.next_trial() and search.next_trial() and search.next_trial() is None


def test_validate_says_pbt_may_run_a_trial_past_its_planned_epochs():
    from raydp_train.checks.validation import sweep_spending

    pipeline = load_pipeline(SWEEP, ["tune.scheduler=pbt"])
    how = sweep_spending(pipeline, check_pipeline(pipeline, for_training=False)[1])[2]
    assert how == ("composition of 6 trials at their planned epochs; pbt may run a continued "
                   "trial longer, and the budget, which counts every epoch, bounds the sweep")


BAYESOPT_SPACE = ("tune.search_space={privacy.noise_multiplier: {uniform: [1.2, 2.0]}, "
                  "training.lr: {uniform: [0.003, 0.03]}}")


@pytest.mark.parametrize("search", ["optuna", "hyperopt", "bayesopt"])
def test_an_adaptive_search_is_seeded_by_run_seed(search):
    """Tune's own integration, seeded: the same first trials on every run of the sweep, and
    other trials for another seed, 0 included (a seed of 0 is a seed, not "unseeded")."""
    overrides = [f"tune.search={search}"] + ([BAYESOPT_SPACE] if search == "bayesopt" else [])
    seeded = load_pipeline(SWEEP, [*overrides, "run.seed=0"])
    first = drawn(seeded)
    assert len(first) == 6 and drawn(seeded) == first
    # the benchmark's seeds 0 and 1: their very first trials already differ
    assert drawn(load_pipeline(SWEEP, [*overrides, "run.seed=1"]))[0] != first[0]


def test_a_search_without_its_package_is_one_line_naming_the_extra(monkeypatch):
    import importlib.util

    from raydp_train.checks import sweep_spending
    from raydp_train.checks.sweep_spending import check_search_space

    pipeline = load_pipeline(SWEEP, ["tune.search=optuna"])
    found = importlib.util.find_spec
    monkeypatch.setattr(sweep_spending.importlib.util, "find_spec",
                        lambda name, *a: None if name == "optuna" else found(name, *a))
    with pytest.raises(UserError) as caught:
        check_search_space(pipeline, check_pipeline(pipeline, for_training=False)[1])
    assert str(caught.value) == (
        "tune.search: optuna needs the 'optuna' package, which is not installed: pip install "
        "'raydp-train[search]' (or choose search: random)")


def test_tune_without_the_search_package_says_so_in_one_line_before_ray(monkeypatch, tmp_path,
                                                                        capsys):
    import importlib.util

    from raydp_train.checks import sweep_spending
    from raydp_train.commands.cli import main
    from raydp_train.runs import resources

    found = importlib.util.find_spec
    monkeypatch.setattr(sweep_spending.importlib.util, "find_spec",
                        lambda name, *a: None if name == "hyperopt" else found(name, *a))
    monkeypatch.setattr(resources, "connect", lambda *a, **k: pytest.fail("Ray was started"))
    settings = ["tune.search=hyperopt", f"run.output_dir={tmp_path}/runs",
                f"budget.ledger={tmp_path}/budgets"]
    assert main(["tune", SWEEP, *(x for s in settings for x in ("--set", s))]) == 2
    assert capsys.readouterr().err == (
        "error: tune.search: hyperopt needs the 'hyperopt' package, which is not installed: "
        "pip install 'raydp-train[search]' (or choose search: random)\n")
    assert not (tmp_path / "budgets").exists() and not (tmp_path / "runs").exists()


def _epsilons(q: float, sigma: float, steps: int, releases: int) -> list[float]:
    """dp-accounting itself, at three deltas: a trial of `steps` Poisson-sampled Gaussian steps
    and `releases` noisy validation counts (sigma 4)."""
    events = [dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        q, dp_accounting.GaussianDpEvent(sigma)), steps)]
    if releases:
        events.append(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(4.0),
                                                        releases))
    accountant = rdp.RdpAccountant()
    accountant.compose(dp_accounting.ComposedDpEvent(events))
    return [accountant.get_epsilon(delta) for delta in (1e-3, 1e-5, 1e-9)]


SPACE = "training.batch_size: {choice: [64, 256]}, training.epochs: {grid: [2, 6]}"


@pytest.mark.parametrize("noise", [
    [f"tune.search_space={{privacy.noise_multiplier: {{choice: [1.2, 2.0]}}, {SPACE}}}"],
    # each trial's sigma calibrated to epsilon 3 for its own (q, steps); public validation rows
    [f"tune.search_space={{{SPACE}}}", "privacy.noise_multiplier=null",
     "privacy.target_epsilon=3", "data.validation.private=false"]])
@pytest.mark.thorough
def test_a_searched_batch_size_and_epochs_are_bounded_by_one_costliest_trial(noise):
    """Every (batch, epochs, sigma) a trial can get costs no more, at any delta, than the
    bound validate and random stopping use: the largest q, the most steps and releases, and
    the smallest sigma of the search space."""
    from raydp_train.train.plan import make_plan

    pipeline = load_pipeline(SWEEP, noise)
    _, plan = check_pipeline(pipeline)
    bound = worst_trial_spend(pipeline, plan)
    n = plan.num_examples
    trials = [make_plan(load_pipeline(SWEEP, [*noise, f"training.batch_size={b}",
                                              f"training.epochs={e}"]), n)
              for b in (64, 256) for e in (2, 6)]
    sigmas = [1.2, 2.0] if pipeline.privacy.noise_multiplier else [t.noise_multiplier
                                                                    for t in trials]
    assert bound.sampling_rate == 256 / n and bound.noise_multiplier == min(sigmas)
    assert bound.steps == max(t.steps for t in trials) == trials[1].steps  # batch 64, 6 epochs
    assert bound.releases == (6 if plan.releases_per_epoch else 0)
    ceiling = _epsilons(bound.sampling_rate, bound.noise_multiplier, bound.steps, bound.releases)
    for trial in trials:
        for sigma in (sigmas if pipeline.privacy.noise_multiplier else [trial.noise_multiplier]):
            own = _epsilons(trial.sampling_rate, sigma, trial.steps,
                            trial.epochs * trial.releases_per_epoch)
            assert all(a <= b for a, b in zip(own, ceiling, strict=True)), (trial, sigma)
    # Not searched: the bound is the pipeline's own trial.
    plain = load_pipeline(SWEEP)
    _, own_plan = check_pipeline(plain)
    assert worst_trial_spend(plain, own_plan).steps == own_plan.steps


def test_warmup_must_fit_the_trial_with_the_fewest_steps():
    """Each searched field's extremes pass alone, but the smallest number of epochs at the
    largest batch runs fewer steps than warmup_steps: refused before any budget is touched."""
    from raydp_train.checks.sweep_spending import check_search_space
    from raydp_train.config.training import TrainingSetupError

    space = "tune.search_space={training.batch_size: {choice: [64, 512]}, training.epochs: {choice: [1, 8]}}"
    pipeline = load_pipeline(SWEEP, [space, "training.warmup_steps=3"])
    _, plan = check_pipeline(pipeline)  # 8 epochs at batch 128: warmup 3 fits
    # N = 1150: 1 epoch at batch 512 is floor(1150 / 512) = 2 steps
    with pytest.raises(TrainingSetupError, match="may get 3 warmup steps, but .* runs only 2 "):
        check_search_space(pipeline, plan)
    fitting = load_pipeline(SWEEP, [space, "training.warmup_steps=2"])
    check_search_space(fitting, check_pipeline(fitting)[1])
