"""`raydp-train audit`: an empirical privacy audit of the DP-SGD engine with a Dirac canary.

The pipeline's small model (logistic or mlp) gets one extra input, zero for every real example,
so only a canary example ever writes to the weights that read it. The canary's loss is unit 0 of
the first Linear layer's output, a loss linear in that output: its gradient is the same at
every step, M on the watched weight W[0, extra] and 1 on the bias b[0] (norm ~M >> C). The real
engine (Poisson sampling, per-example clipping, one noise draw, / qN) trains `trials` runs with
and `trials` without the canary. The adversary of DP-SGD's analysis sees every step's noisy
gradient; along the watched weight, in units of C, step t shows

    x_t = B * g^_t[W[0, extra]] / C  ~  N(s * [canary sampled at t], sigma^2),
    s = M / sqrt(M^2 + 1)   (the share of the clipped canary gradient on the watched weight)

(the real examples add exactly 0 there), and the run's score is the log-likelihood ratio of
"in" against "out" (accounting/audit_bounds.py). A threshold test on the scores, Clopper-Pearson
and the (epsilon, delta) inequalities give a lower bound on the epsilon of the audited configuration:
the pipeline's q, sigma, C, delta and steps, whose claimed epsilon comes from the accountant.
An audit is an experiment, not a release: it spends nothing from any budget.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from copy import deepcopy
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from raydp_train.accounting.audit_bounds import (
    MembershipTest,
    largest_provable_epsilon,
    membership_test,
    subsampled_gaussian_score,
)
from raydp_train.accounting.epsilon import epsilon_spent
from raydp_train.data.targets import ClassIds, label_kind
from raydp_train.models.builders import ModelError, build_model
from raydp_train.optim.optimizer import make_optimizer
from raydp_train.privacy.clipping import PerExampleClipper
from raydp_train.privacy.mechanism import MECHANISMS, mechanism_named
from raydp_train.privacy.noise import make_generator, noise_std
from raydp_train.privacy.sampling import micro_batches, poisson_sample
from raydp_train.privacy.user_sampling import (
    sample_user_rows,
    user_rows,
    whole_user_micro_batches,
)
from raydp_train.train.plan import PlanError, PrivacyPlan
from raydp_train.train.step import cross_entropy_loss, private_step

AUDITABLE_MODELS = ("logistic", "mlp")
# The canary's label marks its row; real labels are >= 0.
CANARY_LABEL = -1
# The canary's value on the extra input, relative to C: its gradient is clipped by ~1000x,
# so all but ~5e-7 of its clipped norm C lands on the watched weight.
CANARY_INPUT_PER_CLIP_NORM = 1000.0
# privacy.unit user: the canary is a user of this many canary rows (at most rows_per_user),
# whose summed gradient is clipped once: per-row clipping would show CANARY_ROWS times C.
CANARY_ROWS = 4


@dataclass(frozen=True)
class AuditResult:
    pipeline: str
    claimed_epsilon: float  # by the pipeline's accountant, for exactly the audited runs
    accountant: str
    delta: float
    sampling_rate: float
    noise_multiplier: float
    clip_norm: float
    steps: int  # per training run
    trials: int  # training runs with the canary, and as many without
    seed: int  # every run's sampling and noise come from generators seeded by it
    elapsed_s: float
    test: MembershipTest  # on the held-out half of the runs
    unit: str = "example"  # privacy.unit: the canary is an example, or a user of several rows

    @property
    def epsilon_lower_bound(self) -> float:
        return self.test.epsilon_lower_bound

    @property
    def consistent(self) -> bool:
        """True when the measured lower bound does not exceed the claim."""
        return self.epsilon_lower_bound <= self.claimed_epsilon

    @property
    def epsilon_ceiling(self) -> float:
        """The largest lower bound these many held-out runs could show at all."""
        test = self.test
        return largest_provable_epsilon(test.positives, test.negatives, self.delta,
                                        test.confidence)

    def as_dict(self) -> dict:
        return {**asdict(self), "epsilon_lower_bound": self.epsilon_lower_bound,
                "epsilon_ceiling": self.epsilon_ceiling, "consistent": self.consistent,
                "budget_spent": False}


def check_auditable(pipeline, trials: int) -> None:
    """Refuse, before loading anything, what this audit cannot measure."""
    mechanism = mechanism_named(pipeline.privacy.mechanism)
    if not mechanism.auditable:
        auditable = sorted(name for name, cls in MECHANISMS.items() if cls.auditable)
        raise PlanError(
            f"privacy.mechanism: the audit measures {', '.join(auditable)}, got "
            f"{mechanism.name!r}" + ("" if mechanism.private
                                     else " (not private: there is no claim to audit)"))
    if pipeline.model.kind not in AUDITABLE_MODELS:
        raise ModelError(
            f"model.kind: the audit trains many small models in this process and supports "
            f"{' and '.join(AUDITABLE_MODELS)}, got {pipeline.model.kind!r}; audit the same "
            "privacy settings (privacy.*, training.batch_size, training.epochs) with "
            "--set model.kind=logistic")
    if not isinstance(label_kind(pipeline.data), ClassIds):
        raise ModelError("data.label_kind: the audit's canary is a class-id row; audit the same "
                         "privacy settings on class labels (the claim does not depend on them)")
    if isinstance(trials, bool) or int(trials) != trials or trials < 4:
        raise PlanError(f"--trials: need at least 4 runs with the canary (and as many without) "
                        f"to choose a threshold on half and count on the other half, got {trials}")


def audit_pipeline(
    pipeline,
    dataset,
    plan: PrivacyPlan,
    trials: int,
    confidence: float = 0.95,
    seed: int | None = None,
    on_progress: Callable[[int, float], None] | None = None,
) -> AuditResult:
    """Train `trials` runs with and `trials` without the canary; bound epsilon from their scores.

    `dataset` and `plan` come from preflight's `check_pipeline`. `seed`: None draws one from
    os.urandom (and reports it). `on_progress(pairs_done, elapsed_s)` about every 10%.
    """
    check_auditable(pipeline, trials)
    if plan.steps < 1:
        raise PlanError("training.epochs: the audit needs at least one training step, got "
                        f"{plan.steps} steps")
    claimed = epsilon_spent(plan.sampling_rate, plan.noise_multiplier, plan.steps, plan.delta,
                            plan.accountant)
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
    runs = _CanaryRuns(pipeline, dataset, plan, seed)
    sampling_generator, _ = make_generator(seed)
    noise_generator, _ = make_generator(seed + 1)
    scores: dict[bool, list[float]] = {True: [], False: []}
    started, every = time.monotonic(), max(1, trials // 10)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: handing work to threads costs more than the math
    try:
        for pair in range(1, trials + 1):
            for with_canary in (True, False):
                observations = runs.train(with_canary, sampling_generator, noise_generator)
                scores[with_canary].append(subsampled_gaussian_score(
                    observations, plan.sampling_rate, plan.noise_multiplier, runs.signal))
            if on_progress is not None and (pair % every == 0 or pair == trials):
                on_progress(pair, time.monotonic() - started)
    finally:
        torch.set_num_threads(threads)
        runs.close()
    return AuditResult(
        pipeline=pipeline.name, claimed_epsilon=claimed, accountant=plan.accountant,
        delta=plan.delta, sampling_rate=plan.sampling_rate,
        noise_multiplier=plan.noise_multiplier, clip_norm=plan.clip_norm, steps=plan.steps,
        trials=trials, seed=seed, elapsed_s=time.monotonic() - started,
        test=membership_test(scores[True], scores[False], plan.delta, confidence),
        unit=plan.unit,
    )


class _CanaryRuns:
    """The pipeline's model with one extra input, its training set, the canary as row N."""

    def __init__(self, pipeline, dataset, plan: PrivacyPlan, seed: int):
        self.plan, self.training = plan, pipeline.training
        dataset = dataset.to_torch()
        real = dataset.train_features.reshape(dataset.num_train, -1).float()
        extra = real.shape[1]  # index of the extra input
        canary_input = CANARY_INPUT_PER_CLIP_NORM * max(plan.clip_norm, 1.0)
        rows = 1 if plan.unit == "example" else min(CANARY_ROWS, plan.rows_per_user)
        canary = torch.zeros(rows, extra + 1)
        canary[:, extra] = canary_input
        self.features = torch.cat([nn.functional.pad(real, (0, 1)), canary])
        self.labels = torch.cat([dataset.train_labels, torch.full((rows,), CANARY_LABEL)])
        self.num_real = dataset.num_train
        self.users = None  # privacy.unit user: every row's user, the canary user last
        if plan.unit == "user":
            real_users = dataset.train_users.long()
            self.users = torch.cat([real_users, torch.full((rows,), int(real_users.max()) + 1)])
        with torch.random.fork_rng():  # seed the initialization, not the global RNG
            torch.manual_seed(seed)
            self.model = build_model(pipeline.model, (extra + 1,), dataset.num_classes)
        self.first_layer = next(m for m in self.model.modules() if isinstance(m, nn.Linear))
        self.initial_state = deepcopy(self.model.state_dict())
        self.clipper = PerExampleClipper(self.model, plan.clip_norm, unit=plan.unit,
                                         user_contribution=plan.user_contribution)
        self.watched = self.clipper.slots[self.first_layer]["weight"][0, extra]  # a view
        # The canary's gradient (M on the watched weight, 1 on the bias) clipped to norm C.
        self.signal = canary_input / math.hypot(canary_input, 1.0)
        self.noise_std = noise_std(plan.noise_multiplier, plan.clip_norm)

    def losses(self, model: nn.Module, features: Tensor, labels: Tensor) -> Tensor:
        """Real rows: cross-entropy. The canary row: unit 0 of the first layer's output."""
        is_canary = labels == CANARY_LABEL
        losses = cross_entropy_loss(model, features, labels.clamp(min=0))
        if is_canary.any():  # without it, the exact path of a normal run
            losses = torch.where(is_canary, self.first_layer(features)[:, 0], losses)
        return losses

    def train(self, with_canary: bool, sampling_generator, noise_generator) -> list[float]:
        """One training run from the same initialization; x_t of every step (module docstring)."""
        plan = self.plan
        self.model.load_state_dict(self.initial_state)
        self.model.train()
        optimizer = make_optimizer(self.model, self.training)
        in_units_of_clip_norm = plan.expected_batch_size / plan.clip_norm
        observations = []
        for _ in range(plan.steps):
            batches = self._sample(with_canary, sampling_generator)
            private_step(self.model, self.clipper, optimizer, batches, self.losses,
                         self.noise_std, plan.expected_batch_size, noise_generator)
            observations.append(self.watched.item() * in_units_of_clip_norm)
        return observations

    def _sample(self, with_canary: bool, generator: torch.Generator) -> list[tuple]:
        """A step's micro-batches: rows, or users whole with their ids (the canary last)."""
        size, plan = self.training.max_physical_batch, self.plan
        if self.users is None:
            population = self.num_real + int(with_canary)  # the canary is the last row
            sample = poisson_sample(population, plan.sampling_rate, generator)
            return [(self.features[i], self.labels[i]) for i in micro_batches(sample, size)]
        users = self.users if with_canary else self.users[:self.num_real]
        rows, ids = sample_user_rows(user_rows(users), plan.sampling_rate, plan.rows_per_user,
                                     generator)
        return [(self.features[i], self.labels[i], u)
                for i, u in whole_user_micro_batches(rows, ids, size)]

    def close(self) -> None:
        self.clipper.close()


def audit_text(result: AuditResult) -> str:
    """The audit's report: the claim, the measured lower bound and whether they agree."""
    test = result.test
    verdict = ("yes: the lower bound does not exceed the claim" if result.consistent else
               "NO: the runs leak more than the accountant claims (a bug in clipping, noise, "
               "sampling or accounting)")
    rows = [
        ("claimed epsilon", (f"{result.claimed_epsilon:.4f} ({result.accountant.upper()}, "
                             f"these {result.steps} steps)")),
        ("empirical lower bound", (f"{result.epsilon_lower_bound:.4f} "
                                   f"({test.confidence:.0%} confidence, Clopper-Pearson)")),
        ("largest it could show", (f"{result.epsilon_ceiling:.4f} with {test.positives} + "
                                   f"{test.negatives} held-out runs (a perfect test); more "
                                   "--trials raise it")),
        ("consistent", verdict),
        ("membership test", (f"score >= {test.threshold:.4g} on the {test.positives} + "
                             f"{test.negatives} held-out runs: {test.true_positives} true, "
                             f"{test.false_positives} false positives")),
        ("runs", (f"{result.trials} with and {result.trials} without a Dirac canary, in this "
                  f"process, 1 worker ({result.elapsed_s:.1f}s); threshold chosen on the other "
                  "half")),
        ("seeded", (f"audit seed {result.seed} (sampling and noise generators; rerun with "
                    "run.seed to reproduce)")),
        ("budget", "nothing spent: audit runs are experiments, not releases"),
    ]
    canary = "" if result.unit == "example" else f", per user (a canary user of {CANARY_ROWS} rows)"
    header = (f"audit of {result.pipeline}: DP-SGD{canary}, q={result.sampling_rate:.4g}, "
              f"sigma={result.noise_multiplier:.4g}, C={result.clip_norm:g}, "
              f"{result.steps} steps, delta={result.delta:g}")
    footer = "a lower bound, not a guarantee: above the claim it proves a leak; below, nothing"
    return "\n".join([header, *(f"{label:<23} {value}" for label, value in rows), footer])
