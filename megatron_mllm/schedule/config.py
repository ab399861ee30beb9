"""The job a schedule is planned for: models, parallel sizes, batch and hardware."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_mllm.errors import ConfigError
from megatron_mllm.parallel.plans import ParallelPlan, backbone_plan
from megatron_mllm.schedule.hardware import HardwareProfile
from megatron_mllm.schedule.specs import TransformerSpec


@dataclass(frozen=True)
class Recompute:
    """Activation recomputation, by Megatron's argument names. The backbone's runs inside
    megatron-core's TransformerBlock (full: chunks of `num_layers` layers ("uniform") or the
    first `num_layers` of each stage ("block") keep only their input; selective: the core
    attention is recomputed); the encoder's (`vision`) recomputes each layer unit whole,
    keeping its input."""

    granularity: str | None = None  # None, "full" or "selective"
    method: str | None = None  # full: "uniform" or "block"
    num_layers: int | None = None  # full: layers per chunk (uniform) / per stage (block)
    vision: bool = False  # --recompute-vision

    def backbone_overrides(self) -> dict:
        """megatron-core TransformerConfig fields for the backbone."""
        if self.granularity is None:
            return {}
        if self.granularity == "selective":
            return dict(recompute_granularity="selective")
        return dict(
            recompute_granularity="full",
            recompute_method=self.method,
            recompute_num_layers=self.num_layers,
        )

    def recomputed_layers(self, layers: int) -> int:
        """How many of a stage's `layers` backbone layers full recomputation covers."""
        if self.granularity != "full":
            return 0
        return min(layers, self.num_layers) if self.method == "block" else layers


NO_RECOMPUTE = Recompute()


MAX_MICROBATCHES = 4096  # per pipeline and step: far above any real job, below what lists hold


@dataclass(frozen=True)
class MLLMJob:
    """One training job: encoders + projector + backbone on `gpus` GPUs.

    `seq_len` is the backbone's sequence length; an encoder uses its own `seq_len` if its spec
    sets one, else `encoder_seq_len`, else `seq_len`.
    """

    encoders: tuple[TransformerSpec, ...]
    backbone: TransformerSpec
    gpus: int
    tp: int
    pp: int
    global_batch: int
    micro_batch: int
    seq_len: int
    hw: HardwareProfile
    vpp: int = 1
    frozen_encoders: bool = False
    sequence_parallel: bool = True
    encoder_seq_len: int | None = None
    recompute: Recompute = NO_RECOMPUTE
    ddp_bucket_size: int | None = None  # parameters per DDP bucket; None: megatron-core's
    # The encoders' load: images per sample on average (conversation data: the data set's
    # mean, text-only samples counting 0); a micro-batch's encoder work scales with it.
    images_per_sample: float = 1.0
    # Backbone layers per pipeline stage when the user fixed them (Megatron's
    # --decoder-first/last-pipeline-num-layers); empty: the schedule chooses.
    backbone_split: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.validate()

    @property
    def plan(self) -> ParallelPlan:
        return backbone_plan(self.gpus, self.tp, self.pp, self.vpp)

    @property
    def num_microbatches(self) -> int:
        return self.global_batch // (self.micro_batch * self.plan.dp)

    def encoder_seq(self, spec: TransformerSpec) -> int:
        return spec.seq_len or self.encoder_seq_len or self.seq_len

    def validate(self) -> None:
        """Raise ConfigError (one line) for a job that cannot run."""
        for name, value in (
            ("global batch", self.global_batch),
            ("micro-batch", self.micro_batch),
            ("sequence length", self.seq_len),
        ):
            if value < 1:
                raise ConfigError(f"{name} is {value}; it must be a positive integer")
        if not 0 <= self.images_per_sample < 1e6:
            raise ConfigError(f"images per sample {self.images_per_sample}: give a number >= 0")
        if not self.encoders:
            raise ConfigError("no encoder given; pass at least one --encoder")
        plan = self.plan  # checks GPU count against TP x PP
        if self.global_batch % (self.micro_batch * plan.dp):
            raise ConfigError(
                f"global batch {self.global_batch} is not divisible by micro-batch x DP = "
                f"{self.micro_batch} x {plan.dp} = {self.micro_batch * plan.dp}; use a multiple "
                f"of {self.micro_batch * plan.dp}"
            )
        if self.num_microbatches > MAX_MICROBATCHES:
            raise ConfigError(
                f"global batch {self.global_batch} makes {self.num_microbatches} micro-batches "
                f"per pipeline, over {MAX_MICROBATCHES} (a schedule lists every one); give a "
                "smaller global batch or a larger micro-batch"
            )
        if self.pp * self.vpp > self.backbone.num_layers:
            raise ConfigError(
                f"{self.pp * self.vpp} pipeline stages (PP {self.pp} x VPP {self.vpp}) but "
                f"{self.backbone.name} has {self.backbone.num_layers} layers; use at most "
                f"{self.backbone.num_layers} stages"
            )
        split = self.backbone_split
        if split and (len(split) != self.pp or sum(split) != self.backbone.num_layers):
            raise ConfigError(
                f"backbone split {list(split)} does not give {self.backbone.num_layers} layers "
                f"to {self.pp} stages"
            )
        if split and self.vpp > 1:
            raise ConfigError("a fixed backbone split needs VPP 1 (an interleaved one is even)")
        if self.backbone.hidden_size % self.tp or self.backbone.num_heads % self.tp:
            raise ConfigError(
                f"TP {self.tp} does not divide {self.backbone.name}'s hidden size "
                f"{self.backbone.hidden_size} and {self.backbone.num_heads} heads"
            )
        names = [e.name for e in self.encoders]
        if len(set(names)) != len(names):
            raise ConfigError(f"encoder names must be distinct, got {', '.join(names)}")
