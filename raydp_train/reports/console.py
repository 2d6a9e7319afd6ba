"""What a run prints: its epoch rows, progress within a long epoch, and the summary. Used by
the CLI and by the Python API's defaults."""

from __future__ import annotations

from raydp_train.accounting.epsilon import PLD_MIN_NOISE_MULTIPLIER


def epoch_printer(epochs: int):
    """Each epoch's row, ending in the epoch's own time and the time since the workers
    started (`elapsed_s`); after a restart of the workers the clock starts again."""
    last = {"elapsed_s": 0.0}

    def show(row: dict) -> None:
        validation = (f"val acc {row['validation_accuracy']:.4f}  "
                      if "validation_accuracy" in row else "")
        elapsed = row["elapsed_s"]
        took = elapsed - last["elapsed_s"] if elapsed >= last["elapsed_s"] else elapsed
        last["elapsed_s"] = elapsed
        print(f"epoch {row['epoch']:>3}/{epochs}  step {row['steps']:>6}  "
              f"train loss {row['train_loss']:.4f}  {held_out_text(row)}  "
              f"{validation}epsilon {row['epsilon']:.3f}  ({took:.1f}s; {elapsed:.1f}s elapsed)",
              flush=True)
    return show


def progress_printer(epochs: int):
    def show(row: dict) -> None:
        done, total = row["step"] - row["first_step"], row["last_step"] - row["first_step"]
        left = row["epoch_elapsed_s"] / max(done, 1) * (total - done)
        print(f"  epoch {row['epoch']:>3}/{epochs}  step {row['step']:>6}  {done}/{total} of the "
              f"epoch's steps  ({row['epoch_elapsed_s']:.0f}s, about {left:.0f}s left)",
              flush=True)
    return show


# Held-out metrics as an epoch line shows them (those a row has, in this order).
HELD_OUT = {"test_accuracy": ("test acc", ".4f"), "test_label_accuracy": ("test label acc", ".4f"),
            "test_mse": ("test mse", ".4f"), "test_loss": ("test loss", ".4f"),
            "test_perplexity": ("test ppl", ".2f")}
# A run's baselines as its summary names them.
BASELINES = {"chance": "chance", "test_majority_class": "the test split's majority class",
             "test_majority_per_label": "each label's test majority (label accuracy)",
             "test_mean_prediction_mse": "predicting the test mean (mse)"}


def held_out_text(row: dict) -> str:
    """A row's held-out metrics: a classifier's test accuracy, a multi-label model's exact
    and per-label accuracy, a regression's mse, a causal LM's loss and perplexity."""
    return "  ".join(f"{shown} {row[column]:{spec}}" for column, (shown, spec) in HELD_OUT.items()
                     if column in row)


def baselines_text(baselines: dict) -> str:
    return ", ".join(f"{BASELINES[key]} {value:.4f}" for key, value in baselines.items()
                     if key in BASELINES)


def print_summary(record: dict, path) -> None:
    """The end of a run: its last metrics and what it spent, from its record.json (`path`)."""
    from raydp_train.reports.run import noise_description, unit_words

    privacy = record["privacy"]
    delta = privacy["delta"]
    if record["metrics"]:
        last = record["metrics"][-1]
        if "test_perplexity" in last:
            print(f"\ntest loss per token     {last['test_loss']:.4f}  (perplexity "
                  f"{last['test_perplexity']:.2f})")
        else:
            print()
            for column in ("test_accuracy", "test_label_accuracy", "test_mse"):
                if column in last:
                    print(f"{column.replace('_', ' '):<23} {last[column]:.4f}")
            print(f"  to beat               {baselines_text(record['baselines'])}")
        if "validation_accuracy" in last:
            print(f"validation accuracy     {last['validation_accuracy']:.4f}")
    training = record["training"]
    print(f"trained per step        {training['trained_numbers_per_step']:,} of "
          f"{training['model_parameters']:,} parameters (= all-reduce size)")
    print(f"privacy spent           epsilon {privacy['epsilon']:.4f} at delta {delta:g} "
          f"({privacy['accountant'].upper()}, {privacy['steps']} steps), {unit_words(privacy)}")
    if privacy["steps_run_again"]:
        print(f"  of those steps        {privacy['steps_run_again']} ran again after a restart "
              "(released twice, with new noise: both count)")
    print(f"  RDP accountant        epsilon {privacy['epsilon_rdp']:.4f}")
    pld = privacy["epsilon_pld"]
    print("  PLD accountant        " + (f"epsilon {pld:.4f}" if pld is not None else
                                       "not computed (sigma below its smallest, "
                                       f"{PLD_MIN_NOISE_MULTIPLIER})"))
    print(f"  rough estimate        epsilon {privacy['rough_epsilon_estimate']:.4f} "
          "(q*sqrt(T ln(1/delta))/sigma; not a guarantee)")
    if not privacy["private"]:
        print(f"  NOT PRIVATE: privacy.mechanism {privacy.get('mechanism', 'none')} (a reference "
              "run, no guarantee)")
    else:
        print(f"noise                   {noise_description(privacy)}")
        if not privacy["for_release"]:
            print("  noise was seeded (run.seed): reproducible, NOT for release")
    print(f"run record              {path}")


def run_header(pipeline, plan, run_dir) -> str:
    """The lines a run starts with: what it will do, and where it writes."""
    mechanism = plan.mechanism.label
    return (f"{pipeline.name}: {plan.steps} steps of {mechanism} on {plan.num_examples} "
            f"{plan.unit}s, {pipeline.training.workers} worker(s), q={plan.sampling_rate:.4g}, "
            f"sigma={plan.noise_multiplier:.4g}, C={plan.clip_norm:g}\nrun directory: {run_dir}")
