"""`raydp-train validate`: the plan of a checked pipeline, what it will spend (one run, or the
whole sweep of a pipeline with `tune`), and whether its global budget can pay that. The budget
is read from its ledger (no Ray, no accountant actor), as `raydp-train budget status` does."""

from __future__ import annotations

from raydp_train.accounting.epsilon import composed_epsilon
from raydp_train.budget.book import BudgetBook
from raydp_train.budget.ledger import as_uri
from raydp_train.budget.terms import Spend
from raydp_train.config.pipeline import Pipeline, dump_pipeline
from raydp_train.train.plan import PrivacyPlan


def print_validation(pipeline: Pipeline, dataset, plan: PrivacyPlan,
                     model_built: bool = True) -> bool:
    """Print the plan and the spending; False when the budget cannot pay for it.
    `model_built`: whether preflight was asked to build the model."""
    from raydp_train.checks.preflight import structure_checked

    print(dump_pipeline(pipeline), end="")
    print("---")
    if not structure_checked(pipeline, model_built):
        print("model structure         files checked; what trains is checked by `run` before "
              "anything is spent, or now by `validate --check-model` (seconds)")
    print(f"training {plan.unit}s N{' ' * (12 - len(plan.unit))}{plan.num_examples} "
          f"(test {len(dataset.test_labels)})")
    print(f"sampling rate q         {plan.sampling_rate:.6g} (expected batch {plan.expected_batch_size})")
    print(f"steps                   {plan.steps}")
    if not plan.private:
        print(f"NOT PRIVATE             privacy.mechanism {plan.mechanism.name}: no clipping, no "
              "noise, epsilon inf")
        return True
    how = "calibrated to target_epsilon" if plan.noise_calibrated else "given"
    print(f"noise multiplier sigma  {plan.noise_multiplier:.6g} ({how})")
    print(f"clip norm C             {plan.clip_norm:g}")
    releases = plan.epochs * plan.releases_per_epoch
    extra = f", incl. {releases} noisy validation releases" if releases else ""
    print(f"will spend              epsilon {plan.epsilon():.4f} at delta {plan.delta:g} "
          f"({plan.accountant.upper()}{extra}){' per trial' if pipeline.tune else ''}")
    if pipeline.tune is not None:
        sweep = _sweep_spend(pipeline, plan)
    if pipeline.budget is None:
        return True
    book = _print_budget(pipeline)
    if pipeline.tune is None:
        return _payable(book, "this run", plan.spend(plan.steps, releases))
    return _sweep_payable(book, pipeline, plan, sweep)


def _sweep_spend(pipeline: Pipeline, plan: PrivacyPlan) -> Spend:
    """Print and return what the whole search spends at most (ARCHITECTURE.md §2.7)."""
    spend, epsilon, how = sweep_spending(pipeline, plan)
    print(f"the sweep will spend    epsilon {epsilon:.4f} at delta {plan.delta:g} "
          f"({plan.accountant.upper()}, {how}, each trial counted as the costliest: sigma "
          f"{spend.noise_multiplier:.4g}, q {spend.sampling_rate:.4g}, {spend.steps} steps)")
    return spend


def sweep_spending(pipeline: Pipeline, plan: PrivacyPlan) -> tuple[Spend, float, str]:
    """(what the whole search spends at most, its epsilon, how it is counted)."""
    from raydp_train.checks.sweep_spending import (
        check_search_space,
        random_stopping_spend,
        trial_count,
        trials_spend,
    )

    check_search_space(pipeline, plan)  # every searched value, as `tune` checks them
    config = pipeline.tune
    if config.selection == "random_stopping":
        spend = random_stopping_spend(pipeline, plan)
        how = (f"random stopping, mean {config.random_stopping.mean_trials:g} trials: one "
               "reservation")
    else:
        spend = trials_spend(pipeline, plan, trial_count(config))
        how = f"composition of {trial_count(config)} trials"
        if config.scheduler == "pbt":  # a continued trial: its epochs before, then the rest
            how += (" at their planned epochs; pbt may run a continued trial longer, and the "
                    "budget, which counts every epoch, bounds the sweep")
    return spend, composed_epsilon([spend.dp_event()], plan.delta, plan.accountant), how


def spending(pipeline: Pipeline, plan: PrivacyPlan) -> dict:
    """What validate says besides the plan, as values: the whole sweep's epsilon (None without
    `tune`), the budget's epsilon left and whether it can pay all of it (None without one)."""
    from raydp_train.budget.ledger_reading import book_of

    whole = plan.spend(plan.steps, plan.epochs * plan.releases_per_epoch)
    sweep_epsilon = None
    if pipeline.tune is not None:
        whole, sweep_epsilon, _ = sweep_spending(pipeline, plan)
    left = can_pay = None
    if pipeline.budget is not None and plan.private:
        book = book_of(pipeline.budget, pipeline.run.output_dir, pipeline.privacy.unit)
        left, can_pay = book.status()["epsilon_remaining"], _propose(book, whole).granted
    return {"sweep_epsilon": sweep_epsilon, "budget_epsilon_left": left,
            "budget_can_pay": can_pay}


def _print_budget(pipeline: Pipeline) -> BudgetBook:
    from raydp_train.budget.ledger_reading import book_of

    budget = pipeline.budget
    book = book_of(budget, pipeline.run.output_dir, pipeline.privacy.unit)
    status = book.status()
    print(f"spends from budget      {budget.name} (epsilon {budget.epsilon:g}, delta "
          f"{budget.delta:g}, {budget.accountant.upper()}; ledger {as_uri(budget.ledger)})")
    print(f"budget left             epsilon {status['epsilon_remaining']:.4f} of "
          f"{budget.epsilon:g} ({status['epsilon_counted']:.4f} counted, open reservations "
          "in full)")
    return book


def _payable(book: BudgetBook, what: str, spend: Spend) -> bool:
    decision = _propose(book, spend)
    if decision.granted:
        print(f"budget after            epsilon {decision.epsilon_after:.4f} of "
              f"{decision.budget_epsilon:g} once {what} has spent all it may")
    else:
        print(f"CANNOT BE PAID          {what} would bring the budget to epsilon "
              f"{decision.epsilon_after:.4f} of {decision.budget_epsilon:g}; use another "
              "budget.name, spend less, or see `raydp-train budget status`")
    return decision.granted


def _sweep_payable(book: BudgetBook, pipeline: Pipeline, plan: PrivacyPlan, sweep: Spend) -> bool:
    """A random-stopping sweep is paid in full or not at all; trials of a composition sweep
    are paid one by one, and those the budget cannot pay stop "budget exhausted"."""
    from raydp_train.checks.sweep_spending import trial_count, trials_spend

    if pipeline.tune.selection == "random_stopping" or _propose(book, sweep).granted:
        return _payable(book, "the sweep", sweep)
    trials = trial_count(pipeline.tune)
    paid = 0
    while paid < trials and _propose(book, trials_spend(pipeline, plan, paid + 1)).granted:
        paid += 1
    if paid == 0:
        return _payable(book, "one trial", trials_spend(pipeline, plan, 1))
    print(f"PARTLY PAID             the budget pays for {paid} of the {trials} trials at that "
          "sigma; the others will stop \"budget exhausted\"")
    return True


def _propose(book: BudgetBook, spend: Spend):
    decision, _, _ = book.propose("validate", "validate", spend)  # decides, changes nothing
    return decision
