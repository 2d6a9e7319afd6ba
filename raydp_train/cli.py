"""`raydp-train validate | run | tune | audit PIPELINE [--set a.b=value ...]`,
`raydp-train report RUN_DIR`, `raydp-train generate RUN_DIR --prompt TEXT`,
`raydp-train budget status | history | verify | reset NAME [--ledger PATH]`."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import traceback
from pathlib import Path

from raydp_train.budget_commands import add_budget_command
from raydp_train.config.pipeline import PipelineError, load_pipeline
from raydp_train.errors import UserError
from raydp_train.generate import add_generate_command
from raydp_train.predict import add_predict_command
from raydp_train.quiet import quiet_third_party
from raydp_train.worker_errors import WorkerBug

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


def _prepare(args):
    """Load and check everything before any privacy is spent (see preflight). `run` tokenizes
    text with Ray Data, so Ray starts (or is joined) first; `validate` starts no Ray and reads
    no model weights: it checks the pipeline, not this machine."""
    from raydp_train.locations import check_locations, warn_if_not_shared
    from raydp_train.preflight import check_pipeline

    pipeline = load_pipeline(args.pipeline, args.overrides)
    check_locations(pipeline, args.pipeline)
    for_training = args.command is not validate
    if for_training:
        from raydp_train.resources import connect

        connect(args.address, pipeline.training, max(4, pipeline.training.workers + 2),
                args.verbose)
    warn_if_not_shared(pipeline, args.address)
    dataset, plan = check_pipeline(pipeline, for_training, getattr(args, "check_model", True))
    return pipeline, dataset, plan


def validate(args) -> int:
    pipeline, dataset, plan = _prepare(args)  # first: it forks before torch is imported
    from raydp_train.validate import print_validation

    return 0 if print_validation(pipeline, dataset, plan, args.check_model) else EXIT_BUDGET_EXHAUSTED


def run(args) -> int:
    from raydp_train.privacy.mechanism import mechanism_named
    from raydp_train.reports.run import new_run_dir, privacy_statement, write_run_record
    from raydp_train.reruns import driving, run_to_continue
    from raydp_train.train.trainer import RunInterrupted, fit
    from raydp_train.worker_errors import explain

    pipeline, dataset, plan = _prepare(args)
    resumed = _resumed_run_dir(args.resume, pipeline) if args.resume else None
    if resumed is None and not args.new:
        resumed = run_to_continue(pipeline, args.pipeline, _same_command(args))
        if resumed is not None:
            print(f"continuing the unfinished run {resumed} of this pipeline from its last "
                  "checkpoint (run.on_interrupted: resume; --new starts another)", flush=True)
    budget = _open_budget(pipeline)  # a bad budget or ledger: refused before a run directory
    run_dir = resumed or new_run_dir(pipeline)
    workers = pipeline.training.workers
    mechanism = mechanism_named(plan.mechanism).label
    print(f"{pipeline.name}: {plan.steps} steps of {mechanism} on {plan.num_examples} examples, "
          f"{workers} worker(s), q={plan.sampling_rate:.4g}, sigma={plan.noise_multiplier:.4g}, "
          f"C={plan.clip_norm:g}\nrun directory: {run_dir}", flush=True)
    try:
        with driving(run_dir):
            result = fit(pipeline, plan, run_dir, on_epoch=_print_epoch(pipeline.training.epochs),
                         budget=budget, owner=run_dir.name, dataset=dataset,
                         on_progress=_print_within_epoch(pipeline.training.epochs))
    except RunInterrupted:
        print(f"\nINTERRUPTED: the last checkpoint is in {run_dir}; the epoch that was running "
              f"stays counted in full.\ncontinue with: {_resume_command(args, run_dir, pipeline)}",
              flush=True)
        return EXIT_INTERRUPTED
    except Exception as error:  # from the workers, under Ray's wrappers: one line (worker_errors)
        explained = explain(error, run_dir)
        if explained is error:
            raise
        raise explained from error
    if result.stop_reason.startswith("interrupted"):
        print(f"\nINTERRUPTED: the last checkpoint is in {run_dir}; every epoch charged was "
              f"run and saved.\ncontinue with: {_resume_command(args, run_dir, pipeline)}", flush=True)
        return EXIT_INTERRUPTED
    if result.steps_charged == 0 and resumed is None:
        # Nothing trained and nothing charged: an untrained model.pt would only mislead.
        shutil.rmtree(run_dir, ignore_errors=True)
        print(f"\nSTOPPED: {result.stop_reason}\nnothing was trained: no run directory kept")
        return EXIT_BUDGET_EXHAUSTED
    privacy = privacy_statement(plan, result, workers)
    record = write_run_record(run_dir, pipeline, result, privacy)
    _print_summary(result, privacy, record)
    if budget is not None:
        from raydp_train.reports.budget import status_text

        print(status_text(budget.status()))
    if result.stop_reason.startswith("target epsilon reached"):
        # The run did what it may: it stopped where one more epoch would pass its target.
        print(f"\nSTOPPED EARLY: {result.stop_reason}")
    elif result.stop_reason != "completed":
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


def _open_budget(pipeline):
    """The pipeline's global budget (created from this driver), or None; prints its state."""
    from raydp_train.budget_actor import open_budget
    from raydp_train.privacy.ledger import as_uri
    from raydp_train.reports.budget import status_text

    if pipeline.budget is None:
        return None
    budget = open_budget(pipeline.budget)
    print(f"{status_text(budget.status()).splitlines()[0]}\nledger: "
          f"{as_uri(pipeline.budget.ledger)}", flush=True)
    return budget


def tune_command(args) -> int:
    from raydp_train.locations import check_locations, warn_if_not_shared
    from raydp_train.resources import connect
    from raydp_train.tune import run_sweep

    pipeline = load_pipeline(args.pipeline, args.overrides)
    if pipeline.tune is None:
        raise PipelineError(args.pipeline, [("tune: required by `raydp-train tune` (search_space, "
                                            "num_samples, ...); see README")])
    check_locations(pipeline, args.pipeline)
    cpus = max(4, pipeline.training.workers + 2)  # as `run`: workers, queue, controller

    def connect_and_warn() -> None:
        connect(args.address, pipeline.training, cpus, args.verbose)
        warn_if_not_shared(pipeline, args.address)

    sweep = run_sweep(pipeline, connect=connect_and_warn)
    return 0 if sweep is not None and sweep.finished_trials else EXIT_BUDGET_EXHAUSTED


def audit_command(args) -> int:
    import json

    from raydp_train.canary_audit import audit_pipeline, audit_text, check_auditable
    from raydp_train.preflight import check_pipeline

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


def _resumed_run_dir(run_dir: str, pipeline) -> Path:
    """The run directory to resume, after checking it belongs to this very pipeline."""
    from raydp_train.config.pipeline import dump_pipeline

    saved = Path(run_dir) / "pipeline.yaml"
    if not saved.is_file():
        raise PipelineError(run_dir, ["--resume: not a run directory (no pipeline.yaml)"])
    if saved.read_text() != dump_pipeline(pipeline):
        raise PipelineError(
            run_dir, [f"--resume: {saved} is a different pipeline; resume with the same one"]
        )
    return Path(run_dir)


def report(args) -> int:
    from raydp_train.reports.run import metrics_table, noise_description, read_record, write_plots

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
          f"{privacy['steps']} steps, {privacy['workers']} worker(s)")
    print(f"noise: {noise_description(privacy)}")
    if record.get("baselines"):
        print(f"to beat: {_baselines_text(record['baselines'])}")
    for plot in write_plots(record, Path(args.run_dir)):
        print(f"wrote {plot}")
    return 0


def _print_epoch(epochs: int):
    def show(row: dict) -> None:
        validation = (f"val acc {row['validation_accuracy']:.4f}  "
                      if "validation_accuracy" in row else "")
        print(f"epoch {row['epoch']:>3}/{epochs}  step {row['steps']:>6}  "
              f"train loss {row['train_loss']:.4f}  {_test_text(row)}  "
              f"{validation}epsilon {row['epsilon']:.3f}  ({row['elapsed_s']:.1f}s)", flush=True)
    return show


def _print_within_epoch(epochs: int):
    def show(row: dict) -> None:
        done, total = row["step"] - row["first_step"], row["last_step"] - row["first_step"]
        left = row["epoch_elapsed_s"] / max(done, 1) * (total - done)
        print(f"  epoch {row['epoch']:>3}/{epochs}  step {row['step']:>6}  {done}/{total} of the "
              f"epoch's steps  ({row['epoch_elapsed_s']:.0f}s, about {left:.0f}s left)",
              flush=True)
    return show


def _test_text(row: dict) -> str:
    """A classifier's test accuracy, or a causal LM's held-out loss and perplexity."""
    if "test_accuracy" in row:
        return f"test acc {row['test_accuracy']:.4f}"
    return f"test loss {row['test_loss']:.4f}  test ppl {row['test_perplexity']:.2f}"


def _baselines_text(baselines: dict) -> str:
    return (f"chance {baselines['chance']:.4f}, the test split's majority class "
            f"{baselines['test_majority_class']:.4f}")


def _print_summary(result, privacy: dict, record) -> None:
    from raydp_train.reports.run import noise_description

    delta = privacy["delta"]
    if result.metrics:
        last = result.metrics[-1]
        if "test_accuracy" in last:
            print(f"\ntest accuracy           {last['test_accuracy']:.4f}")
            print(f"  to beat               {_baselines_text(result.baselines)}")
        else:
            print(f"\ntest loss per token     {last['test_loss']:.4f}  (perplexity "
                  f"{last['test_perplexity']:.2f})")
        if "validation_accuracy" in last:
            print(f"validation accuracy     {last['validation_accuracy']:.4f}")
    print(f"trained per step        {result.trained_per_step:,} of "
          f"{result.model_parameters:,} parameters (= all-reduce size)")
    print(f"privacy spent           epsilon {privacy['epsilon']:.4f} at delta {delta:g} "
          f"({privacy['accountant'].upper()}, {privacy['steps']} steps)")
    if privacy["steps_run_again"]:
        print(f"  of those steps        {privacy['steps_run_again']} ran again after a restart "
              "(released twice, with new noise: both count)")
    print(f"  RDP accountant        epsilon {privacy['epsilon_rdp']:.4f}")
    print(f"  PLD accountant        epsilon {privacy['epsilon_pld']:.4f}")
    print(f"  rough estimate        epsilon {privacy['rough_epsilon_estimate']:.4f} "
          "(q*sqrt(T ln(1/delta))/sigma; not a guarantee)")
    if not privacy["private"]:
        print(f"  NOT PRIVATE: privacy.mechanism {privacy.get('mechanism', 'none')} (a reference "
              "run, no guarantee)")
    else:
        print(f"noise                   {noise_description(privacy)}")
        if not privacy["for_release"]:
            print("  noise was seeded (run.seed): reproducible, NOT for release")
    print(f"run record              {record}")


if __name__ == "__main__":
    sys.exit(main())
