"""What a schedule's actions cost: kernel lists, transfer and collective times, memory."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from megatron_mllm.errors import ConfigError
from megatron_mllm.schedule.cost_model import Kernel, scaled_kernels, split_weight_grads
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
    # A split backward (`with_weight_split`): [enc][stage] weight-gradient kernels (EW), and
    # encoder_bwd then holds only the input-gradient ones. Empty: not split.
    encoder_wgt: list[list[list[Kernel]]] = field(default_factory=list)
    transfer_s: dict[str, float] = field(default_factory=dict)  # by TensorKey.cost_name
    dp_s: dict[tuple[int, str, str], float] = field(default_factory=dict)  # (rank, AG|RS, part)
    # (rank, part) -> DDP gradient buckets: each is reduced once the part's last backward has
    # produced its share (megatron-core's overlapped reduction); absent: one bucket
    dp_buckets: dict[tuple[int, str], int] = field(default_factory=dict)
    # (rank, part) -> the simulated ranks holding the same part in its DP group (a colocated
    # encoder replicated over pipeline ranks): its reduce-scatter ends no earlier than theirs
    dp_peers: dict[tuple[int, str], tuple[int, ...]] = field(default_factory=dict)
    backbone_act_bytes: dict[tuple[int, int], float] = field(default_factory=dict)
    encoder_act_bytes: list[list[float]] = field(default_factory=list)  # [enc][stage]
    state_bytes: list[float] = field(default_factory=list)  # model states per GPU, per rank
    memory_bytes: float = float("inf")  # device memory
    # Per micro-batch: its encoder load relative to the load the encoder costs above are for
    # (images in it over images costed; 0 for a text-only micro-batch). Empty: 1 for each.
    encoder_load: tuple[float, ...] = ()
    # The balanced baseline folds encoder layers into backbone stages: (stage, chunk) -> the
    # (forward, backward) compute seconds of that stage that are encoder work.
    folded_encoder_s: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict)
    # Fixed seconds each backbone action spends before its kernels, which nothing fills
    # (`HardwareProfile.chunk_overhead_s`).
    chunk_overhead_s: float = 0.0
    # Calibrated on a running job (runtime plan candidates): the same fixed seconds before each
    # encoder action, and seconds added to every point-to-point message's transfer.
    encoder_overhead_s: float = 0.0
    message_latency_s: float = 0.0
    # Kernel lists at a load, made once per workload and shared by its `at_loads` copies.
    _scaled: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    # key -> (transfer seconds at load 1, the micro-batch whose load scales it, or None)
    _transfers: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def at_loads(self, loads: tuple[float, ...]) -> Workload:
        """This workload with per-micro-batch encoder loads `loads` (kernel lists made for a
        load are shared with it: they depend on the load alone)."""
        out = replace(self, encoder_load=tuple(loads))
        out._scaled, out._transfers = self._scaled, self._transfers
        return out

    def load_of(self, mb: int | None) -> float:
        """Micro-batch `mb`'s encoder load factor (1 without per-micro-batch loads, and for a
        look-ahead micro-batch beyond the loads given)."""
        if not self.encoder_load or mb is None or mb >= len(self.encoder_load):
            return 1.0
        return self.encoder_load[mb]

    def kernels(
        self,
        kind: str,
        stage: int,
        chunk: int = 0,
        enc: int = 0,
        mb: int | None = None,
        split: bool = False,
    ) -> list[Kernel]:
        """An action's kernels; an encoder action's (or a backbone stage's folded encoder
        work) for micro-batch `mb`'s load. A backbone B with `split` is its input-gradient
        kernels, a W its weight-gradient ones (`ScheduleMeta.backbone_wgrad`)."""
        if kind in ("F", "B", "W"):
            kernels = (self.backbone_fwd if kind == "F" else self.backbone_bwd)[(stage, chunk)]
            folded = self.folded_encoder_s.get((stage, chunk))
            load = self.load_of(mb)
            if folded is not None and load != 1.0:
                kernels = _with_encoder_share(kernels, folded[kind != "F"], load)
            if kind == "F" or (kind == "B" and not split):
                return kernels
            return split_weight_grads(kernels)[kind == "W"]
        table = {"EF": self.encoder_fwd, "EB": self.encoder_bwd, "EW": self.encoder_wgt}
        kernels = table[kind][enc][stage]
        load = self.load_of(mb)
        if load == 1.0:
            return kernels
        key = (kind, enc, stage, load)
        out = self._scaled.get(key)
        if out is None:
            out = self._scaled[key] = scaled_kernels(kernels, load)
        return out

    def encoder_stage_bytes(self, enc: int, stage: int, mb: int | None = None) -> float:
        """Activation bytes an encoder stage keeps for micro-batch `mb` (its load's share)."""
        if not self.encoder_act_bytes:
            return 0.0
        return self.encoder_act_bytes[enc][stage] * self.load_of(mb)

    def transfer_time(self, key: str | TensorKey) -> float:
        """Seconds to move the tensor `key` to another rank (0 where no cost is filed for its
        kind; an encoder tensor's for its micro-batch's load). Raises ValueError if `key` is
        not a key."""
        base = self._transfers.get(key)
        if base is None:
            k = key if isinstance(key, TensorKey) else TensorKey.parse(key)
            seconds = self.transfer_s.get(k.cost_name, 0.0)
            base = self._transfers[key] = (seconds, k.mb if k.enc is not None else None)
        seconds, mb = base
        return (seconds if mb is None else seconds * self.load_of(mb)) + self.message_latency_s

    def check_matches(self, meta: ScheduleMeta) -> None:
        """Raise ConfigError if this workload does not describe `meta`'s model."""
        if self.encoder_load:
            if len(self.encoder_load) not in (meta.num_microbatches, meta.total_microbatches):
                raise ConfigError(
                    f"{len(self.encoder_load)} encoder loads for "
                    f"{meta.num_microbatches} micro-batches; give one per micro-batch"
                )
            if any(not 0 <= x < float("inf") for x in self.encoder_load):
                raise ConfigError(f"encoder loads {list(self.encoder_load)}: each must be >= 0")
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
            wgt = [len(k) for k in self.encoder_wgt[e]] if len(self.encoder_wgt) > e else []
            if (
                tuple(fwd) != enc.fwd_kernels
                or tuple(bwd) != enc.bwd_kernels
                or tuple(wgt) != enc.wgt_kernels
            ):
                raise ConfigError(
                    f"encoder {e}: workload kernel counts fwd {fwd} bwd {bwd} weight {wgt} do "
                    f"not match the schedule's fwd {list(enc.fwd_kernels)} bwd "
                    f"{list(enc.bwd_kernels)} weight {list(enc.wgt_kernels)}"
                )

    def compute_seconds(self, kernels: list[Kernel]) -> float:
        return sum(k.compute_s for k in kernels)


def _with_encoder_share(kernels: list[Kernel], encoder_s: float, load: float) -> list[Kernel]:
    """A stage's kernels with its `encoder_s` seconds of encoder compute at `load` (the
    difference spread over its kernels in proportion to their compute)."""
    total = sum(k.compute_s for k in kernels)
    if total <= 0:
        return kernels
    factor = (total + (load - 1.0) * encoder_s) / total
    return [k.timed(k.compute_s * factor) for k in kernels]


def with_weight_split(meta: ScheduleMeta, workload: Workload) -> tuple[ScheduleMeta, Workload]:
    """Every trainable encoder's backward split into input-gradient (EB) and weight-gradient
    (EW) kernels: the metadata's kernel counts and the workload's kernel lists."""
    encoders, bwd, wgt = [], [], []
    for e, enc in enumerate(meta.encoders):
        split = [split_weight_grads(k) for k in workload.encoder_bwd[e]]
        if not enc.trainable or not any(dw for _, dw in split):
            encoders.append(enc)
            bwd.append(workload.encoder_bwd[e])
            wgt.append([])
            continue
        bwd.append([dx for dx, _ in split])
        wgt.append([dw for _, dw in split])
        encoders.append(replace(enc, wgt_kernels=tuple(len(dw) for _, dw in split)))
    return (
        replace(meta, encoders=tuple(encoders)),
        replace(workload, encoder_bwd=bwd, encoder_wgt=wgt),
    )
