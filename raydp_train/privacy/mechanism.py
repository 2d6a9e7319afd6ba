"""Privacy mechanisms (ARCHITECTURE.md §2.8): what differs between DP-SGD, LSG and the
non-private reference, and nothing else, behind one interface registered by name.

What every mechanism shares stays where it is: Poisson sampling, micro-batching, the one noise
draw on rank 0 (its std from `noise_std` here), the one all-reduce, the division by q*N, the
noisy metric releases and the budget. A mechanism decides which per-example gradients are
computed and clipped (`attach`), what of the flat gradient buffer is all-reduced and how it
reaches the parameters (`reduce`, `write_back`), any state it derives from the weights
(`refresh`, re-derived after a restore), and what one step costs (`dp_event`).

No torch and no dp-accounting at module level: the budget's book asks `dp_event` here and
must not load torch, and validate's forked model check (checks/preflight.py) must not load
dp-accounting; each method imports what it uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    import dp_accounting
    import torch
    from torch import Tensor, nn

MECHANISMS: dict[str, type[Mechanism]] = {}


def register_mechanism(cls: type[Mechanism]) -> type[Mechanism]:
    """Class decorator: `privacy.mechanism: <cls.name>` selects `cls`."""
    if cls.name in MECHANISMS:
        raise ValueError(f"mechanism {cls.name!r} is already registered ({MECHANISMS[cls.name]})")
    MECHANISMS[cls.name] = cls
    return cls


def mechanism_named(name: str) -> type[Mechanism]:
    try:
        return MECHANISMS[name]
    except KeyError:
        raise ValueError(f"privacy.mechanism: {name!r} is not a registered mechanism; "
                         f"registered: {', '.join(sorted(MECHANISMS))}") from None


def make_mechanism(privacy, generator: torch.Generator | None = None) -> Mechanism:
    """The pipeline's mechanism, for one worker; `generator` draws any randomness of its own
    (LSG's carriers), the same on every rank."""
    return mechanism_named(privacy.mechanism)(privacy, generator)


class Mechanism:
    """DP-SGD's behaviour; other mechanisms override what they change."""

    name: ClassVar[str]
    label: ClassVar[str]  # what the run summary calls it
    private: ClassVar[bool] = True  # False: no clipping, no noise, epsilon infinite
    auditable: ClassVar[bool] = False  # `raydp-train audit` measures it
    # training.sharding fsdp (privacy/sharding.py): "sharded": the trained weights are sharded
    # too and their sums reduce-scattered; "replicated": the trained parameters stay whole on
    # every rank, the frozen ones are sharded; or why it cannot shard (`sharding_refused`).
    sharding: ClassVar[str] = "sharded"
    sharding_refused: ClassVar[str | None] = None

    def __init__(self, privacy=None, generator: torch.Generator | None = None) -> None:
        self.privacy, self.generator = privacy, generator

    @classmethod
    def dp_event(cls, sampling_rate: float, noise_multiplier: float,
                 steps: int) -> dp_accounting.DpEvent:
        """`steps` Poisson-subsampled Gaussian mechanisms on a sum of contributions of norm
        at most C, noised with std sigma*C (ARCHITECTURE.md §2.5)."""
        from raydp_train.accounting.epsilon import dpsgd_event

        return dpsgd_event(sampling_rate, noise_multiplier, steps)

    @staticmethod
    def noise_std(noise_multiplier: float, clip_norm: float) -> float:
        return noise_multiplier * clip_norm

    def attach(self, model: nn.Module, clip_norm: float):
        """The gradient engine of `model`: per-example gradients clipped to `clip_norm` and
        summed into one flat buffer bound as the trained parameters' `.grad`."""
        from raydp_train.privacy.clipping import PerExampleClipper

        return PerExampleClipper(model, clip_norm, other_layers=self.other_layers,
                                 stability=self.stability, unit=self.unit,
                                 quantile=self.quantile(clip_norm),
                                 user_contribution=self.user_contribution)

    @property
    def stability(self) -> float | None:
        """privacy.clipping automatic: its gamma; None: fixed clipping."""
        if getattr(self.privacy, "clipping", "flat") != "automatic":
            return None
        return self.privacy.stability

    def quantile(self, clip_norm: float):
        """privacy.clipping adaptive: C's tracker of a target quantile, starting at
        `clip_norm` (privacy/adaptive_clipping.py); None otherwise."""
        if getattr(self.privacy, "clipping", "flat") != "adaptive":
            return None
        from raydp_train.privacy.adaptive_clipping import QuantileClipping

        settings = self.privacy.adaptive
        return QuantileClipping(clip_norm, settings.target_quantile, settings.learning_rate,
                                settings.count_noise)

    @property
    def other_layers(self) -> str:
        """privacy.other_layers: a module without a rule takes the per-example path or is
        refused."""
        return getattr(self.privacy, "other_layers", "per_example")

    @property
    def unit(self) -> str:
        """privacy.unit: what one clipped contribution is, an example or a user (§2.14)."""
        return getattr(self.privacy, "unit", "example")

    @property
    def user_contribution(self) -> str:
        """privacy.user_contribution: a user's clipped vector is its rows' sum or mean."""
        return getattr(self.privacy, "user_contribution", "sum")

    def refresh(self, step: int, epoch: int, force: bool = False) -> None:
        """Re-derive state that depends on the weights (every step, or when forced after a
        restore)."""

    def reduce(self, engine, all_reduce_sum: Callable[[Tensor], None]) -> None:
        """Sum the buffer (noise on rank 0 + local clipped sums) over the workers, in place."""
        all_reduce_sum(engine.flat_grad)

    def write_back(self, engine) -> None:
        """Turn the reduced, normalized buffer into the parameters' gradients (here it
        already is: the buffer is their `.grad`)."""

    def trained(self, engine) -> Tensor:
        """The numbers one step trains (and all-reduces)."""
        return engine.flat_grad

    @staticmethod
    def released(model: nn.Module) -> nn.Module:
        """The model as saved: the one that trained (LoRA: its adapters merged)."""
        return model

    @staticmethod
    def save_extras(model: nn.Module, folder: Path) -> None:
        """Files a run directory holds besides the model (LoRA: the adapters alone)."""


@register_mechanism
class DpSgd(Mechanism):
    """Per-example clipping of every trained parameter's gradient, one noise draw per step
    (Abadi et al. 2016)."""

    name, label, auditable = "dpsgd", "DP-SGD", True


@register_mechanism
class LowRankSparse(Mechanism):
    """LSG (Ito et al. 2022): adapted weights train through low-rank carriers whose kept
    entries alone are clipped, reduced and noised, then mapped back to the weights
    (ARCHITECTURE.md §2.4)."""

    name, label = "lsg", "LSG"
    sharding_refused = ("LSG derives its carriers from whole weights every step and maps them "
                        "back onto whole weights, which FSDP keeps sharded")

    def attach(self, model: nn.Module, clip_norm: float):
        from raydp_train.privacy.clipping import PerExampleClipper
        from raydp_train.privacy.lsg import LowRankSparseGradients

        self.lsg = LowRankSparseGradients(model, self.privacy.lsg, self.generator)
        engine = PerExampleClipper(model, clip_norm, rules=self.lsg.rules,
                                   other_layers=self.other_layers, stability=self.stability,
                                   unit=self.unit, quantile=self.quantile(clip_norm),
                                   user_contribution=self.user_contribution)
        self.lsg.bind(engine.slots, engine.flat_grad)
        return engine

    def refresh(self, step: int, epoch: int, force: bool = False) -> None:
        self.lsg.refresh(step, epoch, force=force)

    def reduce(self, engine, all_reduce_sum: Callable[[Tensor], None]) -> None:
        # Only kept entries carry signal or noise; frozen ones end exactly 0.
        kept = engine.flat_grad[self.lsg.kept]
        all_reduce_sum(kept)
        engine.flat_grad.zero_()
        engine.flat_grad[self.lsg.kept] = kept

    def write_back(self, engine) -> None:
        self.lsg.write_weight_grads(engine.slots)

    def trained(self, engine) -> Tensor:
        return engine.flat_grad[self.lsg.kept]


@register_mechanism
class LowRankAdapters(Mechanism):
    """DP-LoRA (Yu et al. 2022): adapters on chosen Linear layers, base weights frozen; the
    adapters are clipped (their own rule) and noised as DP-SGD clips and noises
    (ARCHITECTURE.md §2.9). Released: the merged model, and the adapters alone."""

    name, label = "lora", "DP-LoRA"
    sharding = "replicated"  # its rule reads the adapters after the backward

    def attach(self, model: nn.Module, clip_norm: float):
        import torch

        from raydp_train.privacy.lora import add_adapters

        seed = int(torch.randint(2**62, (1,), generator=self.generator))  # the same on every rank
        add_adapters(model, self.privacy.lora, seed)
        return super().attach(model, clip_norm)

    @staticmethod
    def released(model: nn.Module) -> nn.Module:
        from raydp_train.privacy.lora import merged

        return merged(model)

    @staticmethod
    def save_extras(model: nn.Module, folder: Path) -> None:
        from raydp_train.privacy.lora import save_adapter

        save_adapter(model, folder / "adapter")


@register_mechanism
class NonPrivate(Mechanism):
    """The non-private reference: plain summed gradients, no clipping, no noise."""

    name, label, private = "none", "NON-PRIVATE SGD", False
    sharding_refused = "the non-private reference binds whole gradient buffers (not sharded yet)"

    @classmethod
    def dp_event(cls, sampling_rate: float, noise_multiplier: float,
                 steps: int) -> dp_accounting.DpEvent:
        import dp_accounting

        return dp_accounting.NonPrivateDpEvent()

    @staticmethod
    def noise_std(noise_multiplier: float, clip_norm: float) -> float:
        return 0.0

    def attach(self, model: nn.Module, clip_norm: float):
        from raydp_train.privacy.nonprivate import SummedGradients

        return SummedGradients(model)
