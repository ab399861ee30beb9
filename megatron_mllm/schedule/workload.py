"""What a schedule's actions cost: kernel lists, transfer and collective times, memory."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_mllm.errors import ConfigError
from megatron_mllm.schedule.cost_model import Kernel
from megatron_mllm.schedule.keys import TensorKey
from megatron_mllm.schedule.schedule import ScheduleMeta


@dataclass
class Workload:
    """Costs for every action of schedules with the same metadata shape.

    Kernel lists are per GPU. Activation bytes are per GPU and per micro-batch.
    """

    backbone_fwd: dict[tuple[int, int], list[Kernel]]  # (stage, chunk) -> kernels
    backbone_bwd: dict[tuple[int, int], list[Kernel]]
    encoder_fwd: list[list[list[Kernel]]] = field(default_factory=list)  # [enc][stage]
    encoder_bwd: list[list[list[Kernel]]] = field(default_factory=list)
    transfer_s: dict[str, float] = field(default_factory=dict)  # by TensorKey.cost_name
    dp_s: dict[tuple[int, str, str], float] = field(default_factory=dict)  # (rank, AG|RS, part)
    # (rank, part) -> DDP gradient buckets: each is reduced once the part's last backward has
    # produced its share (megatron-core's overlapped reduction); absent: one bucket
    dp_buckets: dict[tuple[int, str], int] = field(default_factory=dict)
    backbone_act_bytes: dict[tuple[int, int], float] = field(default_factory=dict)
    encoder_act_bytes: list[list[float]] = field(default_factory=list)  # [enc][stage]
    state_bytes: list[float] = field(default_factory=list)  # model states per GPU, per rank
    memory_bytes: float = float("inf")  # device memory

    def kernels(self, kind: str, stage: int, chunk: int = 0, enc: int = 0) -> list[Kernel]:
        if kind == "F":
            return self.backbone_fwd[(stage, chunk)]
        if kind == "B":
            return self.backbone_bwd[(stage, chunk)]
        if kind == "EF":
            return self.encoder_fwd[enc][stage]
        return self.encoder_bwd[enc][stage]

    def transfer_time(self, key: str | TensorKey) -> float:
        """Seconds to move the tensor `key` to another rank (0 where no cost is filed for its
        kind). Raises ValueError if `key` is not a key."""
        k = key if isinstance(key, TensorKey) else TensorKey.parse(key)
        return self.transfer_s.get(k.cost_name, 0.0)

    def check_matches(self, meta: ScheduleMeta) -> None:
        """Raise ConfigError if this workload does not describe `meta`'s model."""
        for s in range(meta.pp):
            for v in range(meta.vpp):
                if (s, v) not in self.backbone_fwd or (s, v) not in self.backbone_bwd:
                    raise ConfigError(f"workload has no costs for backbone stage {s} chunk {v}")
        if len(self.encoder_fwd) != len(meta.encoders):
            raise ConfigError(
                f"workload has {len(self.encoder_fwd)} encoder(s); the schedule has "
                f"{len(meta.encoders)}"
            )
        for e, enc in enumerate(meta.encoders):
            fwd = [len(k) for k in self.encoder_fwd[e]]
            bwd = [len(k) for k in self.encoder_bwd[e]]
            if tuple(fwd) != enc.fwd_kernels or tuple(bwd) != enc.bwd_kernels:
                raise ConfigError(
                    f"encoder {e}: workload kernel counts fwd {fwd} bwd {bwd} do not match the "
                    f"schedule's fwd {list(enc.fwd_kernels)} bwd {list(enc.bwd_kernels)}"
                )

    def compute_seconds(self, kernels: list[Kernel]) -> float:
        return sum(k.compute_s for k in kernels)
