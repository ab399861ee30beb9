"""Hardware profiles for the analytic cost model."""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatron_mllm.errors import ConfigError


@dataclass(frozen=True)
class HardwareProfile:
    """Peak rates of one GPU and its links. `efficiency` scales every peak to an achievable rate.

    Bandwidths are per GPU, one direction, in GB/s; `internode_gbps` is the GPU's share of the
    node's network injection bandwidth. `chunk_overhead_s` is what one backbone pipeline chunk
    action (one virtual stage's forward or backward of one micro-batch) costs its rank beyond
    its kernels: the launch gap after the stage's point-to-point exchange, its setup and the
    schedule's bookkeeping. Interleaving at VPP v pays it v times per micro-batch.
    """

    name: str
    peak_tflops: float
    hbm_gbps: float
    nvlink_gbps: float
    internode_gbps: float
    memory_gb: float
    gpus_per_node: int = 8
    efficiency: float = 0.5
    latency_s: float = 10e-6  # per collective or p2p message
    chunk_overhead_s: float = 0.0

    def with_efficiency(self, efficiency: float) -> HardwareProfile:
        return replace(self, efficiency=efficiency)

    def with_chunk_overhead(self, seconds: float) -> HardwareProfile:
        return replace(self, chunk_overhead_s=seconds)


# The H100 efficiency and chunk overhead were fitted once by tools/bench_schedule.py (ViT-22B +
# GPT-175B on 3072 GPUs: the simulated Megatron baseline against the paper's 5.91 s, the balanced
# VPP 12 one against its 5.87 s) and are not re-tuned.
_H100_FIT = {"efficiency": 0.4978, "chunk_overhead_s": 3.28e-3}
GPU_PROFILES: dict[str, HardwareProfile] = {
    "h100": HardwareProfile("h100", 989.0, 3350.0, 450.0, 50.0, 80.0, **_H100_FIT),
    # No reference figures for A100 here: it borrows the H100 fit.
    "a100": HardwareProfile("a100", 312.0, 2039.0, 300.0, 25.0, 80.0, **_H100_FIT),
}


def get_profile(name: str) -> HardwareProfile:
    """A built-in profile by name (case-insensitive)."""
    try:
        return GPU_PROFILES[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown GPU '{name}'; use one of {', '.join(GPU_PROFILES)}") from None
