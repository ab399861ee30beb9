"""One rank's start: patches, the process group on the right device, megatron-core's seeds.

Every entry point that runs megatron-core modules (the runtime's run modes, the training loop,
the checkpoint converter, profiling, the benches) starts its rank with `init_rank`.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from megatron_mllm.errors import ConfigError
from megatron_mllm.runtime.assembly.device_env import DEVICE_CONNECTIONS, device_connections_problem


def rank_device(rank: int = 0) -> torch.device:
    """This rank's device: its GPU (torchrun's LOCAL_RANK, else rank modulo the GPUs on the
    node) where CUDA is available, else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
    return torch.device("cuda", local)


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA tensors with gloo beside it for CPU-side control messages; gloo alone on a
    CPU-only machine."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def nccl_messages(backend: str | None = None) -> bool:
    """Whether the default group's tensors travel over NCCL (which matches point-to-point
    messages by posting order, without tags): "nccl", or a composite backend such as
    "cpu:gloo,cuda:nccl" (what `backend_for` gives a GPU rank) that names it."""
    if backend is None:
        backend = dist.get_backend()
    return any(part.split(":")[-1] == "nccl" for part in str(backend).split(","))


def seed_model_parallel(seed: int) -> None:
    """megatron-core's RNG streams (data-parallel, model-parallel, expert) from `seed`.

    Every rank passes TP rank 0 (weights come from the canonical state, and dropout in TP
    regions must match the one-process reference) and expert ranks 0: without them upstream
    asks for an expert-parallel group we never create and asserts, and `etp_rank=None` breaks
    its seed arithmetic. Looked up at call time, so the CPU patch (a CPU tracker) applies."""
    from megatron.core.tensor_parallel import random as mc_random

    # The host generator too, on every device: initial weights are made on the CPU, and
    # upstream's seeding on a GPU seeds only CUDA's (the CPU patch seeds it the same way).
    torch.manual_seed(seed)
    mc_random.model_parallel_cuda_manual_seed(seed, tp_rank=0, ep_rank=0, etp_rank=0)


def init_rank(rank: int, world: int, seed: int, timeout_s: float) -> torch.device:
    """Patches, the default process group and megatron-core's seeds; returns this rank's device.

    On CUDA the group is bound to this rank's GPU (`device_id`), so NCCL creates every later
    group's communicator eagerly, in the order `new_group` is called, which is the same on
    every rank; lazily created communicators would instead be built on the first send of each
    pair, blocking in rank-dependent order."""
    import megatron_mllm_patches

    megatron_mllm_patches.apply_cpu_patches()
    megatron_mllm_patches.apply_runtime_patches()
    problem = device_connections_problem()
    if problem is not None:
        raise ConfigError(problem)
    os.environ.setdefault(DEVICE_CONNECTIONS, "1")  # read when the CUDA context is made
    device = rank_device(rank)
    extra = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        extra["device_id"] = device
    dist.init_process_group(
        backend_for(device),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
        **extra,
    )
    from megatron.core import parallel_state

    parallel_state._set_global_memory_buffer()  # attention's scratch buffer, not parallel state
    seed_model_parallel(seed)
    return device


def partition_subgroups(lists: list[list[int]], backend: str | None = None):
    """This rank's group of `lists`, every group created on every rank in one enumeration.

    Under a GPU-bound default group each rank outside a new group takes part in an NCCL
    "no colour" split of the default group, whatever the new group's backend, and a rank
    inside a gloo group takes part in none: the ranks' split calls pair up only when every
    rank is outside the same number of groups, which holds for a partition of the world (any
    sizes) and is refused for anything else."""
    world = dist.get_world_size()
    members = sorted(r for ranks in lists for r in ranks)
    if members != list(range(world)):
        raise ValueError(f"process groups {lists} do not partition the {world} ranks")
    mine, _ = dist.new_subgroups_by_enumeration(lists, backend=backend)
    return mine
