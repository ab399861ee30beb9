"""Per-kernel times of transformer layers from a hardware profile (or measured JSON).

A layer is a sequence of `Kernel`s. Each kernel has compute time on the compute stream and,
optionally, a tensor-parallel collective that follows it on the communication stream; the next
kernel of the same layer waits for that collective. Those waits are the TP bubbles.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from megatron_mllm.errors import ConfigError
from megatron_mllm.schedule.hardware import HardwareProfile
from megatron_mllm.schedule.specs import TransformerSpec

BF16 = 2
FP32 = 4
FORWARD_KERNELS = ("ln1", "qkv", "attn", "proj", "ln2", "fc1", "act", "fc2")
BACKWARD_KERNELS = tuple(f"{k}_b" for k in reversed(FORWARD_KERNELS))
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")  # a layer's TP collectives
DP_COLLECTIVES = ("reduce_scatter", "all_gather")  # the distributed optimizer's, per part


@dataclass(frozen=True)
class Kernel:
    """One kernel: compute seconds, then `comm_s` seconds of TP collective it must wait for."""

    name: str
    compute_s: float
    comm_s: float = 0.0
    # A backward kernel: the part of `compute_s` that computes weight gradients (a GEMM's
    # backward is its input gradient plus its weight gradient, each about its forward's time).
    wgrad_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s

    def timed(self, compute_s: float) -> Kernel:
        """The same kernel taking `compute_s`, its weight-gradient share kept."""
        share = self.wgrad_s / self.compute_s if self.compute_s > 0 else 0.0
        return replace(self, compute_s=compute_s, wgrad_s=compute_s * share)


def scaled_kernels(kernels: list[Kernel], load: float) -> list[Kernel]:
    """Kernels for `load` times the work they were costed for (compute and its collectives
    linear in it: an encoder's images)."""
    return [Kernel(k.name, k.compute_s * load, k.comm_s * load, k.wgrad_s * load) for k in kernels]


def split_weight_grads(kernels: list[Kernel]) -> tuple[list[Kernel], list[Kernel]]:
    """A backward's kernels as its input-gradient kernels (the collectives stay with them) and
    its weight-gradient kernels ("<name>_w"), for a split backward (zero-bubble's B / W)."""
    dx = [Kernel(k.name, k.compute_s - k.wgrad_s, k.comm_s) for k in kernels]
    dw = [Kernel(k.name.removesuffix("_b") + "_w", k.wgrad_s) for k in kernels if k.wgrad_s > 0]
    return dx, dw


class CostModel:
    """Analytic kernel times for one micro-batch size on one hardware profile."""

    def __init__(
        self,
        hw: HardwareProfile,
        micro_batch: int,
        sequence_parallel: bool = True,
        measured: dict[str, dict[str, dict[str, float]]] | None = None,
    ) -> None:
        self.hw = hw
        self.b = micro_batch
        self.sp = sequence_parallel
        self.measured = measured or {}

    # -- rates ----------------------------------------------------------------------------
    def _flops_s(self, flops: float) -> float:
        return flops / (self.hw.peak_tflops * 1e12 * self.hw.efficiency)

    def _mem_s(self, nbytes: float) -> float:
        return nbytes / (self.hw.hbm_gbps * 1e9 * self.hw.efficiency)

    def _link_gbps(self, group: int) -> float:
        inside_node = group <= self.hw.gpus_per_node
        return self.hw.nvlink_gbps if inside_node else self.hw.internode_gbps

    def _collective_s(self, nbytes: float, group: int, passes: float) -> float:
        """Ring collective over `group` GPUs; `passes` is 1 for RS/AG, 2 for all-reduce."""
        if group <= 1:
            return 0.0
        link = self._link_gbps(group) * 1e9 * self.hw.efficiency
        return passes * (group - 1) / group * nbytes / link + self.hw.latency_s

    # -- transformer layers -----------------------------------------------------------------
    def layer_kernels(
        self, spec: TransformerSpec, seq: int, tp: int, backward: bool
    ) -> list[Kernel]:
        """The kernels of one layer's forward (or backward) on one GPU of a TP group."""
        b, s, h, f = self.b, seq, spec.hidden_size, spec.ffn_hidden_size
        act = b * s * h * BF16
        attn_flops = 4 * b * s * s * h * (0.5 if spec.causal else 1.0)
        sp_div = tp if self.sp else 1
        # With sequence parallelism a TP all-reduce becomes a reduce-scatter plus an all-gather.
        gather = self._collective_s(act, tp, 1) if self.sp else 0.0
        reduce = self._collective_s(act, tp, 1 if self.sp else 2)
        if tp > 1:  # measured collective times where given (see `measured_collective`)
            suffix = "_b" if backward else ""
            gather = self.measured_collective(spec.name, "all_gather" + suffix, gather)
            kind = ("reduce_scatter" if self.sp else "all_reduce") + suffix
            reduce = self.measured_collective(spec.name, kind, reduce)
        fwd = [
            Kernel("ln1", self._mem_s(2 * act / sp_div), gather),
            Kernel("qkv", self._flops_s(2 * b * s * h * 3 * h / tp)),
            Kernel("attn", self._flops_s(attn_flops / tp)),
            Kernel("proj", self._flops_s(2 * b * s * h * h / tp), reduce),
            Kernel("ln2", self._mem_s(2 * act / sp_div), gather),
            Kernel("fc1", self._flops_s(2 * b * s * h * f / tp)),
            Kernel("act", self._mem_s(2 * b * s * f * BF16 / tp)),
            Kernel("fc2", self._flops_s(2 * b * s * f * h / tp), reduce),
        ]
        if backward:
            # Backward: twice the GEMM work (input and weight gradients), 2.5x attention
            # (recomputed scores), mirrored comms.
            factor = {"attn": 2.5}
            comm_after = {"fc1": reduce, "ln2": gather, "qkv": reduce, "ln1": gather}
            gemms = ("qkv", "proj", "fc1", "fc2")
            kernels = [
                Kernel(
                    k.name + "_b",
                    k.compute_s * factor.get(k.name, 2.0),
                    comm_after.get(k.name, 0.0),
                    k.compute_s if k.name in gemms else 0.0,
                )
                for k in reversed(fwd)
            ]
        else:
            kernels = fwd
        return self._apply_measured(spec.name, "backward" if backward else "forward", kernels)

    def head_kernels(
        self, spec: TransformerSpec, seq: int, tp: int, backward: bool
    ) -> list[Kernel]:
        """The LM head (logits and cross entropy) on the last backbone stage."""
        b, v, h = self.b, spec.vocab_size, spec.hidden_size
        if v == 0:
            return []
        forward = self._flops_s(2 * b * seq * h * v / tp)
        # its backward: the input gradient and the output layer's weight gradient, a GEMM each
        logits = (
            Kernel("logits", forward * 2, wgrad_s=forward)
            if backward
            else Kernel("logits", forward)
        )
        loss = Kernel(
            "xent",
            self._mem_s(2 * b * seq * v * FP32 / tp),
            self._collective_s(b * seq * FP32, tp, 2),
        )
        return [loss, logits] if backward else [logits, loss]

    def projector_kernels(
        self, encoder: TransformerSpec, llm: TransformerSpec, seq: int, tp: int, backward: bool
    ) -> list[Kernel]:
        """Two-layer MLP projector, encoder width -> LLM width, at the end of the encoder."""
        b, he, hl = self.b, encoder.hidden_size, llm.hidden_size
        mult = 2 if backward else 1
        fc1_s, fc2_s = (self._flops_s(2 * b * seq * x * hl / tp) for x in (he, hl))
        w = 1.0 if backward else 0.0  # a backward GEMM: its weight gradient is one forward's
        fc1 = Kernel("proj_fc1", fc1_s * mult, 0.0, fc1_s * w)
        fc2 = Kernel(
            "proj_fc2",
            fc2_s * mult,
            self._collective_s(b * seq * hl * BF16, tp, 2),
            fc2_s * w,
        )
        return [fc2, fc1] if backward else [fc1, fc2]

    def measured_collective(self, model: str, kind: str, analytic: float) -> float:
        """Seconds a layer's `kind` TP collective ("all_reduce", "all_gather", "reduce_scatter";
        "_b" for backward's) blocks its next kernel, as measured, else `analytic`."""
        if not self.sp and kind.startswith("all_gather"):
            return analytic
        return self.measured.get(model, {}).get("collectives", {}).get(kind, analytic)

    def _apply_measured(self, model: str, direction: str, kernels: list[Kernel]) -> list[Kernel]:
        times = self.measured.get(model, {}).get(direction)
        if not times:
            return kernels
        return [k.timed(times.get(k.name, k.compute_s)) for k in kernels]

    # -- communication and memory -----------------------------------------------------------
    def p2p_s(self, hidden: int, seq: int, tp: int) -> float:
        """Send one micro-batch's activation (or gradient) to the next pipeline stage."""
        nbytes = self.b * seq * hidden * BF16 / (tp if self.sp else 1)
        cross_node = tp >= self.hw.gpus_per_node
        gbps = self.hw.internode_gbps if cross_node else self.hw.nvlink_gbps
        return nbytes / (gbps * 1e9 * self.hw.efficiency) + self.hw.latency_s

    def dp_gather_s(self, params_per_gpu: float, dp: int) -> float:
        """Distributed optimizer: all-gather of the bf16 parameters over the DP group (what
        `AG` will be; the runtime's `AG` is a no-op until it has a distributed optimizer)."""
        return self._dp_s(params_per_gpu * BF16, dp, "all_gather")

    def dp_reduce_scatter_s(self, params_per_gpu: float, dp: int) -> float:
        """Distributed optimizer: reduce-scatter of the fp32 gradients over the DP group (what
        `RS` will be; the runtime's `RS` is a full all-reduce until then, about twice this)."""
        return self._dp_s(params_per_gpu * FP32, dp, "reduce_scatter")

    def _dp_s(self, nbytes: float, dp: int, kind: str) -> float:
        """A ring collective's seconds over `dp` ranks, at the bandwidth measured in the job
        for `kind` where given (`measured["dp"]["gbps"]`), else the profile's network."""
        if dp <= 1:
            return 0.0
        gbps = self.measured.get("dp", {}).get("gbps", {}).get(kind)
        link = gbps * 1e9 if gbps else self.hw.internode_gbps * 1e9 * self.hw.efficiency
        return (dp - 1) / dp * nbytes / link + self.hw.latency_s

    def layer_input_bytes(self, spec: TransformerSpec, seq: int, tp: int) -> float:
        """What a fully recomputed layer keeps for backward: its bf16 input (split over TP with
        sequence parallelism)."""
        return seq * self.b * spec.hidden_size * BF16 / (tp if self.sp else 1)

    def layer_activation_bytes(self, spec: TransformerSpec, seq: int, tp: int) -> float:
        """Activations one layer keeps for backward, per micro-batch (Korthikanti et al.'s
        count with flash attention: no s^2 term, so selective recomputation of the core
        attention changes nothing here)."""
        sbh = seq * self.b * spec.hidden_size
        return 34 * sbh / tp if self.sp else (10 + 24 / tp) * sbh


def model_state_bytes_per_param(dp: int) -> float:
    """bf16 params + fp32 grads + fp32 master and Adam moments sharded over DP."""
    return BF16 + FP32 + 12 / dp


def load_measured_times(
    path: str, model_names: list[str]
) -> dict[str, dict[str, dict[str, float]]]:
    """Measured per-kernel times: {model: {"forward"|"backward": {kernel: seconds}}}, for
    a model's TP collectives {model: {"collectives": {kind: seconds}}} (the time one blocks its
    layer; kinds all_reduce, all_gather, reduce_scatter, each also with "_b" for backward), and
    optionally the DP collectives' bandwidth {"dp": {"gbps": {DP_COLLECTIVES kind: GB/s}}}."""
    p = Path(path)
    if not p.is_file():
        what = "is a directory" if p.is_dir() else "does not exist"
        raise ConfigError(f"measured-times file {path} {what}; give a JSON file")
    try:
        raw = json.loads(p.read_text())
    except UnicodeDecodeError:
        raise ConfigError(f"measured-times file {path} is not text (not JSON)") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: malformed JSON at line {err.lineno}") from None
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(
            f"{path}: expected a non-empty {{model: {{forward|backward: {{kernel: seconds}}}}}}"
        )
    units = ("embed", "layer", "projector", "head")  # per-unit times (layer-granularity plans)
    names = {
        "forward": set(FORWARD_KERNELS) | set(units),
        "backward": set(BACKWARD_KERNELS) | {u + "_b" for u in units},
        "collectives": {k + b for k in COLLECTIVES for b in ("", "_b")},
    }
    _check_dp_rates(path, raw.get("dp"))
    for model, dirs in raw.items():
        if model == "dp":
            continue
        if model not in model_names:
            raise ConfigError(
                f"{path}: model '{model}' is not in this run; use one of {', '.join(model_names)}"
            )
        for direction, times in (dirs or {}).items():
            if direction not in names:
                raise ConfigError(
                    f"{path}: '{direction}' under {model}; use forward, backward or collectives"
                )
            bad = set(times) - names[direction]
            if bad:
                raise ConfigError(
                    f"{path}: unknown {direction} kernel(s) {', '.join(sorted(bad))} for {model}; "
                    f"known: {', '.join(sorted(names[direction]))}"
                )
            for k, v in times.items():
                if not isinstance(v, (int, float)) or v < 0:
                    raise ConfigError(
                        f"{path}: time of {model} {direction} {k} must be >= 0 seconds"
                    )
    return raw


def _check_dp_rates(path: str, dp) -> None:
    """The optional {"gbps": {kind: GB/s}} entry of a measured-times file."""
    if dp is None:
        return
    rates = dp.get("gbps") if isinstance(dp, dict) and set(dp) == {"gbps"} else None
    if not isinstance(rates, dict) or set(rates) - set(DP_COLLECTIVES):
        raise ConfigError(
            f'{path}: "dp" must be {{"gbps": {{kind: GB/s}}}} with kinds '
            f"{', '.join(DP_COLLECTIVES)}"
        )
    for kind, v in rates.items():
        if not isinstance(v, (int, float)) or v <= 0:
            raise ConfigError(f"{path}: dp {kind} bandwidth must be > 0 GB/s, got {v!r}")
