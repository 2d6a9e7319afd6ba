"""`PrivateStep`'s arguments (ARCHITECTURE.md §2.11), each refused on one line that names it
and the fix, before any noisy gradient exists: the numbers of the analysis, the mechanism and
its own settings (read by the pipeline schema's `privacy` section, so a loop and a pipeline
accept the same values), the noise, and sigma given or calibrated to a target epsilon."""

from __future__ import annotations

from pydantic import ValidationError
from torch import nn

from raydp_train.accounting.epsilon import calibrate_noise_multiplier
from raydp_train.config.errors import describe
from raydp_train.config.privacy import PrivacyConfig
from raydp_train.errors import UserError
from raydp_train.privacy.mechanism import MECHANISMS, Mechanism

NOISE_MODES = ("fast", "secure")


class PrivateStepError(UserError, ValueError):
    """A PrivateStep argument out of range; the message names it and what would be right."""

    def __init__(self, message: str):
        # Unpickled (Ray sends it from a worker), it gets its prefixed message back.
        prefixed = message.startswith("PrivateStep ")
        super().__init__(message if prefixed else f"PrivateStep {message}")


def check_numbers(clip_norm, noise_multiplier, target_epsilon, steps, expected_batch_size,
                  num_examples, delta, max_physical_batch) -> None:
    """The numbers of the analysis; one line for the first that is wrong."""
    problems = [
        (clip_norm > 0, f"clip_norm: must be > 0, got {clip_norm}"),
        ((noise_multiplier is None) != (target_epsilon is None),
         ("noise_multiplier, target_epsilon: give exactly one (sigma itself, or the epsilon "
         "to calibrate sigma to over `steps`)")),
        (noise_multiplier is None or noise_multiplier > 0,
         f"noise_multiplier: must be > 0 (a private step adds noise), got {noise_multiplier}"),
        (target_epsilon is None or target_epsilon > 0,
         f"target_epsilon: must be > 0, got {target_epsilon}"),
        (target_epsilon is None or (isinstance(steps, int) and steps > 0),
         f"steps: target_epsilon needs the planned number of steps (an int > 0), got {steps}"),
        (steps is None or (isinstance(steps, int) and steps > 0),
         f"steps: must be an int > 0 (or None), got {steps!r}"),
        (0 < expected_batch_size <= num_examples,
         f"expected_batch_size: must be in [1, num_examples = {num_examples}], got "
         + str(expected_batch_size)),
        (0 < delta < 1 / max(num_examples, 1),
         f"delta: must be in (0, 1/num_examples), got {delta}"),
        (max_physical_batch >= 1, f"max_physical_batch: must be >= 1, got {max_physical_batch}"),
    ]
    for holds, message in problems:
        if not holds:
            raise PrivateStepError(message)


def check_objects(model, optimizer, loss, steps_per_charge) -> None:
    """What the loop hands over besides numbers; one line for the first that is wrong."""
    problems = [
        (isinstance(model, nn.Module), (f"model: must be a torch.nn.Module, got "
                                       f"{type(model).__name__}")),
        (hasattr(optimizer, "param_groups") and hasattr(optimizer, "step"),
         (f"optimizer: must be an optimizer over the model's parameters (a torch.optim one), "
         f"got {type(optimizer).__name__}")),
        (callable(loss), (f"loss: must be a function (model, *batch) -> per-example losses [B], "
                         f"got {type(loss).__name__}")),
        (steps_per_charge is None or (isinstance(steps_per_charge, int) and steps_per_charge > 0),
         f"steps_per_charge: must be an int > 0 (or None: N // B), got {steps_per_charge!r}"),
    ]
    for holds, message in problems:
        if not holds:
            raise PrivateStepError(message)


def check_noise(noise: str, seed: int | None) -> None:
    if noise not in NOISE_MODES:
        raise PrivateStepError(f"noise: must be one of {', '.join(map(repr, NOISE_MODES))} "
                               f"(run.noise's modes), got {noise!r}")
    if noise == "secure" and seed is not None:
        raise PrivateStepError("noise: 'secure' cannot be seeded (a seed makes the noise "
                               "reproducible, which is for tests only): remove seed")


def privacy_settings(mechanism: str, *, clip_norm: float, noise_multiplier: float | None,
                     target_epsilon: float | None, delta: float, accountant: str,
                     lsg: dict | None, lora: dict | None, self_check: dict | None,
                     other_layers: str, clipping: str = "flat", adaptive: dict | None = None,
                     unit: str = "example", rows_per_user: int | None = None,
                     user_contribution: str = "sum") -> tuple[PrivacyConfig, type[Mechanism]]:
    """The settings as a pipeline's `privacy` section holds them, checked by its schema, and
    the registered mechanism class they name."""
    chosen = MECHANISMS.get(mechanism)
    if chosen is None or not chosen.private:
        private = sorted(name for name, cls in MECHANISMS.items() if cls.private)
        raise PrivateStepError(f"mechanism: must be one of {', '.join(map(repr, private))} "
                               f"(a private step clips and adds noise), got {mechanism!r}")
    # A mechanism's own settings, by keyword: no mechanism is named outside the registry.
    for name, given in dict(lsg=lsg, lora=lora).items():  # noqa: C408
        if given is not None and name != mechanism:
            raise PrivateStepError(f"{name}: only with mechanism={name!r} (its settings), got "
                                   f"mechanism={mechanism!r}")
    fields = dict(mechanism=mechanism,  # noqa: C408 (as above) clip_norm=clip_norm, delta=delta,
                  noise_multiplier=noise_multiplier, target_epsilon=target_epsilon,
                  accountant=accountant, other_layers=other_layers,
                  self_check=self_check or {}, lsg=lsg, lora=lora, clipping=clipping,
                  adaptive=adaptive, unit=unit, rows_per_user=rows_per_user,
                  user_contribution=user_contribution)
    try:
        return PrivacyConfig(**{k: v for k, v in fields.items() if v is not None}), chosen
    except ValidationError as error:
        raise PrivateStepError(describe(error.errors()[0], PrivacyConfig)) from None


def calibrated_sigma(target_epsilon: float, delta: float, sampling_rate: float, steps: int,
                     accountant: str) -> float:
    """The smallest sigma whose epsilon after `steps` is at most the target (dp-accounting's
    calibration, as `privacy.target_epsilon` in a pipeline)."""
    try:
        return calibrate_noise_multiplier(target_epsilon, delta, sampling_rate, steps,
                                          accountant)
    except ValueError as error:
        raise PrivateStepError(f"target_epsilon: {error}") from None



def calibrated_on_rank_0(world, target_epsilon: float, delta: float, sampling_rate: float,
                         steps: int, accountant: str) -> float:
    """Rank 0 calibrates (dp-accounting), every rank gets its sigma or its refusal."""
    answer = None
    if world.rank == 0:
        try:
            answer = calibrated_sigma(target_epsilon, delta, sampling_rate, steps, accountant)
        except PrivateStepError as error:
            answer = str(error)
    answer = world.from_rank_0(answer)
    if isinstance(answer, str):
        raise PrivateStepError(answer.removeprefix("PrivateStep "))
    return answer
