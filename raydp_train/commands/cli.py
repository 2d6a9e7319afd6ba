"""`raydp-train validate | run | tune | audit PIPELINE [--set a.b=value ...]`,
`raydp-train report RUN_DIR`, `raydp-train generate RUN_DIR --prompt TEXT`,
`raydp-train budget status | history | verify | reset NAME [--ledger PATH]`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

from raydp_train.commands.budget import add_budget_command
from raydp_train.commands.generate import add_generate_command
from raydp_train.config.pipeline import load_pipeline
from raydp_train.errors import UserError
from raydp_train.models.predictions import add_predict_command
from raydp_train.reports.console import baselines_text, print_summary
from raydp_train.runs.worker_errors import WorkerBug
from raydp_train.train.quiet import quiet_third_party
from raydp_train.train.stops import StopReason

# `run` and `tune` exit with this when the global budget refused to let them finish.
EXIT_BUDGET_EXHAUSTED = 3
# `audit` exits with this when its lower bound exceeds the claimed epsilon (a proven leak).
EXIT_AUDIT_LEAK = 4
# `run` after Ctrl-C (128 + SIGINT, as shells report it).
EXIT_INTERRUPTED = 130


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    quiet_third_party(args.verbose)  # before transformers or Ray are imported
    try:
        status = args.command(args)
        sys.stdout.flush()  # here, so that a closed pipe is caught below, not at exit
        return status
    except UserError as error:  # the user's input: one clear line, never a traceback
        print(f"error: {error}", file=sys.stderr)
        return 2
    except WorkerBug as error:  # not the input: one line, and where its trace was written
        if args.verbose:
            traceback.print_exception(error.__cause__ or error)
        print(f"error: {error}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader went away (`raydp-train report RUN | head`): stop quietly, as cat does.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="raydp-train", description="Differentially private training pipelines on Ray.",
        parents=[_verbose_option(default=False)])
    commands = parser.add_subparsers(required=True, metavar="COMMAND")
    # Every command takes --verbose after its name too; SUPPRESS keeps one given before it.
    verbose = _verbose_option(default=argparse.SUPPRESS)
    for name, handler, summary in (
        ("validate", validate, "check a pipeline and print what it will spend, without training"),
        ("run", run, "train a pipeline on Ray Train and write its run record"),
        ("tune", tune_command, ("sweep a pipeline's tune.search_space on Ray Tune, every trial "
         "spending from its one global budget")),
        ("audit", audit_command, ("measure a lower bound on the epsilon of the pipeline's DP-SGD "
         "with canary runs in this process (no Ray; spends no budget)")),
    ):
        command = commands.add_parser(name, help=summary, description=summary,
                                      parents=[verbose])
        command.add_argument("pipeline", metavar="PIPELINE", help="pipeline YAML file")
        command.add_argument(
            "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
            help="override a field, e.g. --set privacy.noise_multiplier=1.5 (repeatable)",
        )
        command.set_defaults(command=handler)
        if name in ("run", "tune", "validate"):
            command.add_argument(
                "--address", default=os.environ.get("RAY_ADDRESS"),
                help="Ray cluster to run on (default: $RAY_ADDRESS; unset: an embedded local Ray)"
                + ("; validate starts no Ray, it only checks that what the run writes is on "
                   "storage the cluster shares" if name == "validate" else ""),
            )
        if name == "run":
            again = command.add_mutually_exclusive_group()
            again.add_argument(
                "--resume", metavar="RUN_DIR",
                help="continue an interrupted run of the same pipeline from its last checkpoint "
                     "(without it: the newest unfinished one, see run.on_interrupted)",
            )
            again.add_argument("--new", action="store_true", help=(
                "start another run even if an unfinished run of this pipeline is there"))
        if name == "tune":
            command.add_argument("--new", action="store_true", help=(
                "start another sweep even if an unfinished sweep of this pipeline is there "
                "(without it: the newest unfinished one continues, see run.on_interrupted)"))
        if name == "validate":
            command.add_argument("--check-model", action="store_true", help=(
                "also build a pretrained model (no weights) and check what trains: seconds more"))
        if name == "audit":
            command.add_argument("--trials", type=int, default=100, metavar="N",
                                 help="training runs with the canary, and as many without "
                                 "(default 100)")
            command.add_argument("--json", action="store_true", help="print JSON instead of text")
    report_command = commands.add_parser(
        "report", help="print a run's metrics and privacy statement, and plot them",
        parents=[verbose])
    report_command.add_argument("run_dir", metavar="RUN_DIR")
    report_command.set_defaults(command=report)
    add_generate_command(commands, [verbose])
    add_predict_command(commands, [verbose])
    add_budget_command(commands, [verbose])
    return parser


def _verbose_option(default) -> argparse.ArgumentParser:
    option = argparse.ArgumentParser(add_help=False)
    option.add_argument("--verbose", action="store_true", default=default,
                        help="show the output of Ray, transformers and other libraries "
                             "(progress bars, load reports, their warnings)")
    return option


def validate(args) -> int:
    from raydp_train.api import checked

    pipeline = load_pipeline(args.pipeline, args.overrides)
    dataset, plan = checked(pipeline, check_model=args.check_model, address=args.address,
                            source=args.pipeline)  # first: it forks before torch is imported
    from raydp_train.checks.validation import print_validation

    return 0 if print_validation(pipeline, dataset, plan, args.check_model) else EXIT_BUDGET_EXHAUSTED


def run(args) -> int:
    from raydp_train import api
    from raydp_train.reports.budget import status_text
    from raydp_train.runs.reruns import command_choices

    pipeline = load_pipeline(args.pipeline, args.overrides)
    result = api.run(pipeline, address=args.address, resume=args.resume, new=args.new,
                     verbose=args.verbose, source=args.pipeline,
                     rerun_choices=command_choices(_same_command(args)))
    run_dir = result.run_dir
    if result.status == "interrupted":
        saved = ("the epoch that was running stays counted in full"
                 if result.stop_reason == api.ABORTED else "every epoch charged was run and saved")
        print(f"\nINTERRUPTED: the last checkpoint is in {run_dir}; {saved}.\ncontinue with: "
              f"{_resume_command(args, run_dir, pipeline)}", flush=True)
        return EXIT_INTERRUPTED
    if result.status == "nothing trained":
        print(f"\nSTOPPED: {result.stop_reason}\nnothing was trained: no run directory kept")
        return EXIT_BUDGET_EXHAUSTED
    print_summary(json.loads(result.record.read_text()), result.record)
    if result.budget is not None:
        print(status_text(result.budget))
    if result.stop is StopReason.TARGET_EPSILON_REACHED:
        # The run did what it may: it stopped where one more epoch would pass its target.
        print(f"\nSTOPPED EARLY: {result.stop_reason}")
    elif result.status != "completed":
        print(f"\nSTOPPED: {result.stop_reason}\nthe last checkpoint is in {run_dir}")
        return EXIT_BUDGET_EXHAUSTED
    return 0


def _same_command(args) -> str:
    """The command line of this run: the same pipeline and --set options."""
    options = "".join(f" --set '{override}'" for override in args.overrides or [])
    return f"raydp-train run {args.pipeline}{options}"


def _resume_command(args, run_dir: Path, pipeline) -> str:
    """What continues this run: `--resume`, or (run.on_interrupted: resume) the same command."""
    again = " (or just the same command again)" if pipeline.run.on_interrupted == "resume" else ""
    return f"{_same_command(args)} --resume {run_dir}{again}"


def tune_command(args) -> int:
    from raydp_train import api

    pipeline = load_pipeline(args.pipeline, args.overrides)
    sweep = api.tune(pipeline, address=args.address, verbose=args.verbose, source=args.pipeline,
                     new=args.new)
    return 0 if sweep is not None and sweep.finished_trials else EXIT_BUDGET_EXHAUSTED


def audit_command(args) -> int:
    import json

    from raydp_train.checks.preflight import check_pipeline
    from raydp_train.commands.audit import audit_pipeline, audit_text, check_auditable

    pipeline = load_pipeline(args.pipeline, args.overrides)
    check_auditable(pipeline, args.trials)
    dataset, plan = check_pipeline(pipeline)
    progress_to = sys.stderr if args.json else sys.stdout

    def progress(pairs: int, elapsed_s: float) -> None:
        print(f"audit: {pairs}/{args.trials} pairs of runs ({elapsed_s:.1f}s)", file=progress_to,
              flush=True)

    result = audit_pipeline(pipeline, dataset, plan, args.trials, seed=pipeline.run.seed,
                            on_progress=progress)
    print(json.dumps(result.as_dict(), indent=2) if args.json else audit_text(result))
    return 0 if result.consistent else EXIT_AUDIT_LEAK


def report(args) -> int:
    from raydp_train.reports.run import (
        metrics_table,
        noise_description,
        read_record,
        unit_words,
        write_plots,
    )

    try:
        record = read_record(Path(args.run_dir))
    except FileNotFoundError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(metrics_table(record))
    privacy = record["privacy"]
    print(f"\nprivacy: epsilon {privacy['epsilon']:.4f} at delta {privacy['delta']:g} "
          f"({privacy['accountant'].upper()}), q={privacy['sampling_rate']:.4g}, "
          f"sigma={privacy['noise_multiplier']:.4g}, C={privacy['clip_norm']:g}, "
          f"{privacy['steps']} steps, {privacy['workers']} worker(s), {unit_words(privacy)}")
    print(f"noise: {noise_description(privacy)}")
    if record.get("baselines"):
        print(f"to beat: {baselines_text(record['baselines'])}")
    for plot in write_plots(record, Path(args.run_dir)):
        print(f"wrote {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
