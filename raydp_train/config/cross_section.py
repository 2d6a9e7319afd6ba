"""The rules that span a pipeline's sections (each section checks its own fields in its own
module): a budget only for a private run, a sweep's budget and searched fields, the task's
fields, the sampler, the privacy unit and sharding, each refused by the field to change."""

from __future__ import annotations

from raydp_train.accounting.epsilon import PLD_MIN_NOISE_MULTIPLIER
from raydp_train.config.data import streaming_refusal
from raydp_train.config.errors import FieldProblem
from raydp_train.config.model import is_causal_lm
from raydp_train.config.privacy import mechanism_settings
from raydp_train.privacy.mechanism import mechanism_named


def check_across_sections(p) -> None:
    """Raise the FieldProblem of the first rule `p` (a config/pipeline.py Pipeline, being
    validated) breaks."""
    if not p.privacy.private and p.budget is not None:
        raise FieldProblem(f"a non-private run (privacy.mechanism: {p.privacy.mechanism}) "
                           "cannot spend from a privacy budget", "budget")
    if p.tune is not None:
        _check_tune(p)
    _check_task(p)
    _check_sampler(p)
    _check_unit(p)
    _check_pld_noise(p)
    if p.training.trim_padding and p.model.kind != "hf":
        raise FieldProblem(f"needs model.kind hf (a model that reads the attention mask; "
                           f"model.kind {p.model.kind} may need every data.max_length column): "
                           "set it false", "training.trim_padding")
    if p.training.sharding == "fsdp":
        _check_sharding(p)


def _check_pld_noise(p) -> None:
    """The pld accountant (privacy's or the budget's) only where its grid fits in memory."""
    pld = [f"{name}.accountant" for name, section in (("privacy", p.privacy), ("budget", p.budget))
           if getattr(section, "accountant", None) == "pld"]
    validation = getattr(p.data, "validation", None)
    given = {"privacy.noise_multiplier": p.privacy.noise_multiplier,
             "data.validation.noise_multiplier": getattr(validation, "noise_multiplier", None)}
    for field, sigma in given.items():
        if pld and sigma is not None and sigma < PLD_MIN_NOISE_MULTIPLIER:
            raise FieldProblem(
                f"{sigma:g} is below {PLD_MIN_NOISE_MULTIPLIER}, the smallest the pld "
                f"accountant ({pld[0]}) can account in memory: raise it, or set {pld[0]}: rdp",
                field)


def _check_sampler(p) -> None:
    """`data.sampler: streaming` only where it can serve the pipeline (ARCHITECTURE.md §2.13)."""
    if getattr(p.data, "sampler", "memory") != "streaming":
        return
    refusal = streaming_refusal(p.data, p.training.cache_frozen_prefix,
                                p.tune is not None and p.training.workers == 1)
    if refusal is not None:
        raise FieldProblem(*refusal)


def _check_unit(p) -> None:
    """privacy.unit user: who wrote each row is known, and nothing releases more per user
    than one clipped contribution a step (ARCHITECTURE.md §2.14)."""
    users = getattr(p.data, "user_column", None)
    if p.privacy.unit == "example":
        example_fields = {"data.user_column": users is not None,
                          "privacy.rows_per_user": p.privacy.rows_per_user is not None,
                          "privacy.user_contribution": p.privacy.user_contribution != "sum"}
        for field, given in example_fields.items():
            if given:
                raise FieldProblem("only with privacy.unit: user (set it, or remove this)",
                                   field)
        return
    problems = {
        "data.user_column": (users is None or p.data.source in ("ray_dataset", "hf_dataset"),
                             ("privacy.unit user needs the column naming who wrote each row "
                             "(data.source parquet, csv or json)")),
        "privacy.mechanism": (not p.privacy.private, "privacy.unit user is for a private run"),
        "privacy.rows_per_user": (not p.privacy.rows_per_user or p.privacy.rows_per_user
                                  > p.training.max_physical_batch,
                                  ("privacy.unit user needs the cap on rows a user brings to a "
                                  "step, at most training.max_physical_batch (a user's rows "
                                  "are clipped in one micro-batch)")),
        "data.test_path": (users is not None and getattr(p.data, "test_path", None) is None,
                           ("privacy.unit user: give the test rows a file of their own (a "
                           "train_fraction cut would split users' rows)")),
        "data.validation.fraction": (
            p.data.validation is not None and p.data.validation.fraction is not None,
            ("privacy.unit user: give the validation rows a file of their own (path, with "
             "the user column): a fraction cut would split users' rows")),
        "data.validation.noise_multiplier": (
            p.data.validation is not None and p.data.validation.private
            and p.data.validation.noise_multiplier is None,
            ("privacy.unit user: a private validation file releases its accuracy per user "
             "with noise; set it (or data.validation.private: false)")),
    }
    for field, (bad, message) in problems.items():
        if bad:
            raise FieldProblem(message, field)


def _check_task(p) -> None:
    """causal_lm trains on text alone: each text's targets are its own next tokens."""
    causal = is_causal_lm(p.model)
    if not causal:
        if getattr(p.data, "label_column", "label") is None:
            raise FieldProblem("the labels' column is needed (null only with model.task: "
                               "causal_lm)", "data.label_column")
        return
    if getattr(p.data, "text_column", None) is None:
        raise FieldProblem("model.task causal_lm trains on text: use data.source parquet with "
                           "a text_column", "data")
    if "label_column" in p.data.model_fields_set and p.data.label_column is not None:
        raise FieldProblem("model.task causal_lm uses no labels (each text's targets are its "
                           "own next tokens): remove data.label_column", "data.label_column")
    p.data.label_column = None
    for name in ("label_names", "validation"):
        if getattr(p.data, name) is not None:
            raise FieldProblem(f"not with model.task causal_lm (no classes, no validation "
                               f"accuracy to release): remove data.{name}", f"data.{name}")
    if p.training.cache_frozen_prefix:
        raise FieldProblem("not with model.task causal_lm yet: the prefix cache serves "
                           "classifiers", "training.cache_frozen_prefix")
    if p.tune is not None:
        raise FieldProblem("model.task causal_lm: sweeps select on validation accuracy, which a "
                           "language model has not; run it without tune", "tune")


def _check_sharding(p) -> None:
    """What FSDP sharding cannot serve, refused by name before anything runs."""
    why_not = mechanism_named(p.privacy.mechanism).sharding_refused
    if why_not:
        raise FieldProblem(f"not with privacy.mechanism {p.privacy.mechanism}: {why_not}; use "
                           "dpsgd or lora, or training.sharding: none", "training.sharding")
    if p.training.workers < 2:
        raise FieldProblem("fsdp shards the model over the workers: set training.workers >= 2, "
                           "or training.sharding: none", "training.sharding")
    if getattr(p.model, "frozen_dtype", "fp32") != "fp32":
        raise FieldProblem("not with training.sharding: fsdp yet (FSDP gathers one dtype per "
                           "block, and the trained parameters are fp32): use fp32",
                           "model.frozen_dtype")
    if p.training.cache_frozen_prefix:
        raise FieldProblem("not with training.sharding: fsdp (the prefix cache runs the frozen "
                           "layers outside FSDP's gathering): set it false",
                           "training.cache_frozen_prefix")
    not_yet = {"privacy.clipping": p.privacy.clipping == "adaptive",
               "privacy.unit": p.privacy.unit == "user",
               "data.sampler": getattr(p.data, "sampler", "memory") == "streaming",
               "training.trim_padding": p.training.trim_padding}
    for field, sharded_not_checked in not_yet.items():
        if sharded_not_checked:
            raise FieldProblem("not with training.sharding: fsdp yet (not checked sharded): use "
                               "training.sharding: none", field)


def _check_tune(p) -> None:
    """Cross-section rules of a sweep: one shared budget, and no selection on private data."""
    if p.budget is None:
        raise FieldProblem("a sweep spends from one global budget: add a budget section", "budget")
    space = p.tune.search_space
    if "privacy.noise_multiplier" in space and p.privacy.noise_multiplier is None:
        raise FieldProblem("searching privacy.noise_multiplier needs privacy.noise_multiplier "
                           "set, not target_epsilon", "tune.search_space")
    for name in mechanism_settings():
        if any(key.startswith(f"privacy.{name}.") for key in space) and (
                p.privacy.mechanism != name):
            raise FieldProblem(f"searching privacy.{name} fields needs privacy.mechanism: "
                               f"{name}", "tune.search_space")
    if p.tune.selection == "random_stopping" and p.budget.accountant != "rdp":
        raise FieldProblem("random_stopping is accounted with RDP only (Papernot & Steinke): "
                           "use budget.accountant: rdp", "tune.selection")
    if p.tune.selection == "random_stopping" and p.run.loggers:
        raise FieldProblem(
            "random_stopping releases the best trial alone (Papernot & Steinke), and "
            f"run.loggers {p.run.loggers} would log every trial: use selection: composition, "
            "or no loggers", "run.loggers")
    validation = p.data.validation
    if validation is None:
        raise FieldProblem("tune.metric validation_accuracy needs data.validation "
                           "(fraction, private)", "tune.metric")
    if validation.private and validation.noise_multiplier is None:
        raise FieldProblem(
            "the sweep would select on private validation rows: declare them public with "
            "data.validation.private: false, or release the metric with noise by setting "
            "data.validation.noise_multiplier", "tune.metric")


# --- loading ----------------------------------------------------------------------------------
