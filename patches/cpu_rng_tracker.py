"""An RNG-states tracker on the CPU generator, installed as megatron-core's tracker.

TARGET: megatron/core/tensor_parallel/random.py:235 (CudaRNGStatesTracker.add/fork use the CUDA
        generator), :378 model_parallel_cuda_manual_seed; forked in
        transformer/dot_product_attention.py:217 and at weight initialisation; :41/:72
        _get_cuda_rng_state/_set_cuda_rng_state, which recomputation (CheckpointFunction,
        :444 _get_all_rng_states) calls to restore the forward's RNG states.
CHECKED_ON: megatron-core 0.16.1, torch 2.13.0 (CPU build).
WHY: the tracker saves and restores CUDA RNG states; on CPU we keep the same named streams
(data-parallel seed, model-parallel seed + 2718 + tp_rank, expert seed) on torch's CPU generator,
so dropout and initialisation follow megatron-core's seeding rules. Recomputation saves and
restores torch's CPU generator and the tracker already; there is no CUDA generator to keep.
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core.tensor_parallel import random as mc_random

TARGET = "megatron.core.tensor_parallel.random"
CHECKED_ON = ("0.16.1",)


class CPURNGStatesTracker(mc_random.CudaRNGStatesTracker):
    """Named RNG streams on the CPU generator (same interface as CudaRNGStatesTracker)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__()

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name: str = mc_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def cpu_model_parallel_manual_seed(
    seed: int,
    *args,
    tp_rank: int | None = None,
    ep_rank: int | None = None,
    etp_rank: int | None = None,
    **kwargs,
) -> None:
    """megatron-core's seeding rules, on the CPU generator."""
    if tp_rank is None:
        tp_rank = mc_random.get_tensor_model_parallel_rank()
    ep_rank = 0 if ep_rank is None else ep_rank
    etp_rank = 0 if etp_rank is None else etp_rank
    tracker = CPURNGStatesTracker()
    mc_random._CUDA_RNG_STATE_TRACKER = tracker
    mc_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    torch.manual_seed(seed)
    tracker.add(mc_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mc_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mc_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)


def _no_cuda_rng_state(*args, **kwargs) -> None:
    """The CUDA generator's state on a machine without one: none."""
    return None


def apply() -> None:
    if torch.cuda.is_available():
        return
    mc_random.model_parallel_cuda_manual_seed = cpu_model_parallel_manual_seed
    mc_random._get_cuda_rng_state = _no_cuda_rng_state
    mc_random._set_cuda_rng_state = _no_cuda_rng_state
    if not isinstance(mc_random._CUDA_RNG_STATE_TRACKER, CPURNGStatesTracker):
        mc_random._CUDA_RNG_STATE_TRACKER = CPURNGStatesTracker()
        mc_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
