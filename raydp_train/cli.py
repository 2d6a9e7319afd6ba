"""`raydp-train validate | run PIPELINE [--set a.b=value ...]`."""

from __future__ import annotations

import argparse
import sys

from raydp_train.data import DataError, load_data
from raydp_train.models import ModelError
from raydp_train.pipeline import PipelineError, dump_pipeline, load_pipeline
from raydp_train.plan import PlanError, make_plan
from raydp_train.privacy.clipping import UnsupportedLayerError

# Problems with the user's input: printed as one clear message, never as a traceback.
USER_ERRORS = (PipelineError, DataError, PlanError, ModelError, UnsupportedLayerError)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.command(args)
    except USER_ERRORS as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="raydp-train", description="Differentially private training pipelines on Ray."
    )
    commands = parser.add_subparsers(required=True, metavar="COMMAND")
    for name, handler, summary in (
        ("validate", validate, "check a pipeline and print what it will spend, without training"),
        ("run", run, "train a pipeline and write its run record"),
    ):
        command = commands.add_parser(name, help=summary, description=summary)
        command.add_argument("pipeline", metavar="PIPELINE", help="pipeline YAML file")
        command.add_argument(
            "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
            help="override a field, e.g. --set privacy.noise_multiplier=1.5 (repeatable)",
        )
        command.set_defaults(command=handler)
    return parser


def _prepare(args):
    """Everything that can fail on bad input, before any noisy gradient is released."""
    pipeline = load_pipeline(args.pipeline, args.overrides)
    dataset = load_data(pipeline.data, pipeline.model.num_classes)
    plan = make_plan(pipeline, dataset.num_train)
    return pipeline, dataset, plan


def validate(args) -> int:
    pipeline, dataset, plan = _prepare(args)
    print(dump_pipeline(pipeline), end="")
    print("---")
    print(f"training examples N     {plan.num_examples} (test {len(dataset.test_labels)})")
    print(f"sampling rate q         {plan.sampling_rate:.6g} (expected batch {plan.expected_batch_size})")
    print(f"steps                   {plan.steps}")
    how = "calibrated to target_epsilon" if plan.noise_calibrated else "given"
    print(f"noise multiplier sigma  {plan.noise_multiplier:.6g} ({how})")
    print(f"clip norm C             {plan.clip_norm:g}")
    print(f"will spend              epsilon {plan.epsilon():.4f} at delta {plan.delta:g} "
          f"({plan.accountant.upper()})")
    return 0


def run(args) -> int:
    from raydp_train.report import new_run_dir, privacy_statement, write_run_record
    from raydp_train.train.worker import train

    pipeline, dataset, plan = _prepare(args)
    print(f"{pipeline.name}: {plan.steps} steps of DP-SGD on {plan.num_examples} examples, "
          f"q={plan.sampling_rate:.4g}, sigma={plan.noise_multiplier:.4g}, C={plan.clip_norm:g}",
          flush=True)
    result = train(pipeline, dataset, plan, on_epoch=_print_epoch(pipeline.training.epochs))
    privacy = privacy_statement(plan, result.steps_done, result.noise_mode)
    run_dir = new_run_dir(pipeline)
    record = write_run_record(run_dir, pipeline, result.metrics, privacy, result.model)
    _print_summary(result.metrics[-1], privacy, record)
    return 0


def _print_epoch(epochs: int):
    def show(row: dict) -> None:
        print(f"epoch {row['epoch']:>3}/{epochs}  step {row['steps']:>6}  "
              f"train loss {row['train_loss']:.4f}  test acc {row['test_accuracy']:.4f}  "
              f"epsilon {row['epsilon']:.3f}  ({row['elapsed_s']:.1f}s)", flush=True)
    return show


def _print_summary(last: dict, privacy: dict, record) -> None:
    delta = privacy["delta"]
    print(f"\ntest accuracy           {last['test_accuracy']:.4f}")
    print(f"privacy spent           epsilon {privacy['epsilon']:.4f} at delta {delta:g} "
          f"({privacy['accountant'].upper()}, {privacy['steps']} steps)")
    print(f"  RDP accountant        epsilon {privacy['epsilon_rdp']:.4f}")
    print(f"  PLD accountant        epsilon {privacy['epsilon_pld']:.4f}")
    print(f"  rough estimate        epsilon {privacy['rough_epsilon_estimate']:.4f} "
          "(q*sqrt(T ln(1/delta))/sigma; not a guarantee)")
    if not privacy["for_release"]:
        print("  noise was seeded (run.seed): reproducible, NOT for release")
    print(f"run record              {record}")


if __name__ == "__main__":
    sys.exit(main())
