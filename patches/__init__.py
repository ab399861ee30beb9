"""Every change we make to upstream megatron-core behaviour, one concern per module.

Imported as `megatron_mllm_patches` (setup.py maps it to this folder). Each module names its
TARGET (file and lines in megatron-core), the versions it was CHECKED_ON, WHY it exists, and has
an `apply()` that is idempotent. `apply_cpu_patches()` applies the ones needed to run
megatron-core on CPU with gloo; on a CUDA machine it does nothing.
"""

from __future__ import annotations

import importlib

import megatron.core
import torch

SUPPORTED_MEGATRON_CORE = ("0.16.1",)
CPU_PATCHES = (
    "cuda_device_on_cpu",
    "cpu_rng_tracker",
    "cuda_allocations_on_cpu",
    "distributed_optimizer_on_cpu",
    "clip_vit_position_ids_on_cpu",
    "one_rank_collectives_on_cpu",
)
RUNTIME_PATCHES = (  # on every device
    "safe_checkpoint_loading",
    "async_tp_collectives",
    "sequence_parallel_torch_norm",
    "checkpoint_helpers_die_with_rank",
    "clip_vit_torch_norm",
)


def check_version() -> None:
    version = getattr(megatron.core, "__version__", "unknown")
    if version not in SUPPORTED_MEGATRON_CORE:
        raise RuntimeError(
            f"megatron-core {version} is not one our patches were checked on "
            f"({', '.join(SUPPORTED_MEGATRON_CORE)}); install megatron-core==0.16.1"
        )


def apply_cpu_patches() -> list[str]:
    """Apply the CPU patches when CUDA is not available; return the names applied."""
    if torch.cuda.is_available():
        return []
    check_version()
    applied = []
    for name in CPU_PATCHES:
        module = importlib.import_module(f"{__name__}.{name}")
        module.apply()
        applied.append(name)
    return applied


def apply_runtime_patches() -> list[str]:
    """Apply the patches our runtime uses on every device; return the names applied."""
    check_version()
    for name in RUNTIME_PATCHES:
        importlib.import_module(f"{__name__}.{name}").apply()
    return list(RUNTIME_PATCHES)
