"""What one rank's training run returns (`train/worker.py`): the model, the metrics of each
epoch, what was charged and why the run stopped, and each rank's measurements."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from raydp_train.train.stops import StopReason


@dataclass
class TrainResult:
    model: nn.Module
    metrics: list[dict] = field(default_factory=list)  # one row per epoch
    noise_mode: str = "fast"  # privacy.noise.NOISE_SOURCES says what each mode is
    steps_done: int = 0  # steps of the finished run
    steps_charged: int = 0  # steps charged to the privacy account, restarts included
    releases_charged: int = 0  # noisy validation-metric releases charged
    stop: StopReason = StopReason.COMPLETED  # or why the run stopped early
    stop_reason: str = "completed"  # as shown: "budget exhausted: <the accountant's reason>"
    checksums: list[str] = field(default_factory=list)  # one per rank: all equal
    # Numbers trained (= all-reduced) per step: LSG's kept carrier entries + other params.
    trained_per_step: int = 0
    model_parameters: int = 0
    # std of the last step's reduced (noise + clipped) sum over its trained entries: about
    # sigma*C when the noise dominates; sqrt(W) times that if noise were added per worker.
    final_step_sum_std: float = float("nan")
    baselines: dict = field(default_factory=dict)  # Dataset.accuracy_baselines()
    shard_sizes: list[int] = field(default_factory=list)  # training rows each rank held
    sampler: str = "memory"  # data.sampler as run: memory or streaming (train/samplers.py)
    peak_rss_mb: list[float] = field(default_factory=list)  # each rank's, at the end
    data_mb: list[float] = field(default_factory=list)  # each rank's resident data, read
    threads: list[int] = field(default_factory=list)  # each rank's torch threads
    nodes: list[str] = field(default_factory=list)  # each rank's node (its IP address)
    nodes_ever: list[str] = field(default_factory=list)  # every attempt's nodes, sorted
    # Each rank's (engine self-checks run, their seconds): privacy.self_check's cost.
    self_checks: list[tuple[int, float]] = field(default_factory=list)
    # The modules on the per-example path (privacy.other_layers: per_example), by name.
    per_example_path: list[str] = field(default_factory=list)
    data_shape: tuple = ()  # (one example's feature shape, classes): what rebuilds the model
    ray_result: object = None  # Ray Train's Result of the fit (set on the driver)
