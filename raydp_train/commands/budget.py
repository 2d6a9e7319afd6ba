"""`raydp-train budget status | history | verify | reset`: a global budget seen from its
ledger (no Ray needed), and reset through its accountant."""

from __future__ import annotations

import os
import sys


def add_budget_command(commands, parents: list) -> None:
    """The `budget` command and its views, under the CLI's subcommands."""
    verbose = parents[0]
    budget_command = commands.add_parser(
        "budget", help="show a global privacy budget from its ledger (no Ray needed)",
        parents=[verbose])
    views = budget_command.add_subparsers(required=True, metavar="VIEW")
    for name, handler, summary in (
        ("status", budget_status, "epsilon counted and remaining, steps per owner"),
        ("history", budget_history, "every ledger row: opened, reserved, settled"),
        ("verify", budget_verify, "check the ledger's hash chain and head marker, row by row"),
    ):
        view = views.add_parser(name, help=summary, description=summary, parents=[verbose])
        view.add_argument("name", metavar="NAME", help="budget name (budget.name)")
        view.add_argument("--ledger", type=_ledger, default=None, metavar="PATH_OR_URI",
                          help=LEDGER_HELP)
        view.add_argument("--json", action="store_true", help="print JSON instead of a table")
        view.set_defaults(command=handler)
    views.choices["verify"].add_argument(
        "--runs", default=None, metavar="DIR",
        help="also compare the ledger with every run record under DIR: the ledger row each "
             "saw last, the steps and releases each charged")
    reset = views.add_parser(
        "reset", help="stop counting a budget's settled spending (needs --force; appends a row)",
        description=("Append a reset row to the budget's ledger: spending settled before it no "
                     "longer counts, open reservations still do, and the history is kept."),
        parents=[verbose])
    reset.add_argument("name", metavar="NAME", help="budget name (budget.name)")
    reset.add_argument("--ledger", type=_ledger, default=None, metavar="PATH_OR_URI",
                       help=LEDGER_HELP)
    reset.add_argument("--force", action="store_true", help="really reset (required)")
    reset.add_argument("--reason", default="", help="why; recorded in the reset row")
    reset.add_argument("--address", default=os.environ.get("RAY_ADDRESS"),
                       help="Ray cluster whose jobs use the budget (default: $RAY_ADDRESS; "
                            "unset: an embedded local Ray)")
    reset.set_defaults(command=budget_reset)


LEDGER_HELP = ("the budget's ledger (budget.ledger), e.g. /shared/budgets or s3://b/l "
               "(default: $RAYDP_TRAIN_HOME/budgets, else ~/.raydp_train/budgets)")


def _ledger(value: str) -> str:
    return os.path.expanduser(value)


def _ledger_of(args) -> str:
    """--ledger, else the machine's default ledger (read now: $RAYDP_TRAIN_HOME may be set)."""
    from raydp_train.config.budget import default_ledger

    return args.ledger or default_ledger()


def budget_status(args) -> int:
    from raydp_train.budget.ledger_reading import budget_status
    from raydp_train.reports.budget import as_json, status_text

    status = budget_status(args.name, _ledger_of(args))
    print(as_json(status) if args.json else status_text(status))
    return 0


def budget_history(args) -> int:
    from raydp_train.budget.ledger_reading import ledger_rows
    from raydp_train.reports.budget import as_json, history_text

    rows = ledger_rows(args.name, _ledger_of(args))
    print(as_json(rows) if args.json else history_text(rows))
    return 0


def budget_verify(args) -> int:
    from raydp_train.budget.ledger_reading import verify_ledger
    from raydp_train.reports.budget import as_json

    report = verify_ledger(args.name, _ledger_of(args))  # a damaged ledger: LedgerCorruptError
    if args.runs is not None:
        report.update(_compared_with_runs(args))
    print(as_json(report) if args.json else (
        f"ledger {report['ledger']}: {report['fragments']} fragments, "
        f"{report['chained']} linked by their hashes, head marker at "
        f"{report['head'] or 'none (a ledger written before markers)'}, witness at "
        f"{report['witness'] or 'none'}{_runs_text(report)}: "
        f"{'DIFFERS' if report.get('differences') else 'intact'}"))
    return 2 if report.get("differences") else 0


def _compared_with_runs(args) -> dict:
    from raydp_train.budget.run_witnesses import differences_with_runs

    compared, differences = differences_with_runs(args.name, _ledger_of(args), args.runs)
    for line in differences:
        print(line, file=sys.stderr)
    return {"runs": os.path.abspath(args.runs), "run_records": compared,
            "differences": differences}


def _runs_text(report: dict) -> str:
    if "runs" not in report:
        return ""
    differing = len(report["differences"])
    return (f", {report['run_records']} run records under {report['runs']} compared"
            + (f" ({differing} differences, above)" if differing else ""))


RESET_WARNING = (
    "WARNING: resetting budget '{name}' ({epsilon:.4f} of epsilon {total:g} counted). Data "
    "protected by this budget loses its guarantee of epsilon {total:g} over all releases: the "
    "spending before and after the reset add up. Reset only when the data or its release "
    "policy changed. The ledger keeps the full history; the reset is recorded as a row."
)


def budget_reset(args) -> int:
    """Through the budget's actor (so a live accountant learns of it), never by editing files."""
    import getpass

    from raydp_train.budget.actor import open_existing_budget
    from raydp_train.budget.ledger_reading import budget_status
    from raydp_train.budget.terms import BudgetError
    from raydp_train.reports.budget import status_text
    from raydp_train.runs.resources import check_address
    from raydp_train.train.trainer import ensure_ray

    status = budget_status(args.name, _ledger_of(args))  # missing budget: an error, even forced
    if not args.force:
        raise BudgetError(
            f"budget reset {args.name}: refused without --force. A reset stops counting "
            f"epsilon {status['epsilon_counted']:.4f} already spent; see `raydp-train budget "
            "reset --help`")
    print(RESET_WARNING.format(name=args.name, epsilon=status["epsilon_counted"],
                               total=status["epsilon"]), file=sys.stderr, flush=True)
    check_address(args.address)
    ensure_ray(args.address, num_cpus=1, verbose=args.verbose)
    note = f"reset by {getpass.getuser()}" + (f": {args.reason}" if args.reason else "")
    print(status_text(open_existing_budget(args.name, _ledger_of(args)).reset(note)))
    return 0
