"""torch_dist checkpoints (megatron-core dist_checkpointing) keyed by canonical parameter names.

Every parameter (and its Adam moments) is saved as a ShardedTensor of its full, unsharded shape
with this rank's offsets, so a checkpoint written under one pair of plans loads under any other.
Layout: <save>/iter_0000100/ and <save>/latest_checkpointed_iteration.txt, which rank 0 writes
only after every rank finished the save (an interrupted save is never taken as the latest).
A "model only" checkpoint (common["model_only"], e.g. converted from Hugging Face) holds weights
and no optimizer, scheduler or RNG state.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from megatron_mllm.errors import ConfigError
from megatron_mllm.models.weights import canonical_names, gated_names, gated_view, split_dim

TRACKER = "latest_checkpointed_iteration.txt"


def checkpoint_dir(root: str, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def latest_iteration(root: str, flag: str = "--load") -> int:
    tracker = Path(root) / TRACKER
    if not tracker.is_file():
        raise ConfigError(
            f"{flag} {root}: no {TRACKER} there (no finished checkpoint); "
            f"point {flag} at a --save directory of a run that saved"
        )
    text = tracker.read_text().strip()
    if not text.isdigit() or not checkpoint_dir(root, int(text)).is_dir():
        raise ConfigError(f"{flag} {root}: {TRACKER} says '{text}' but that checkpoint is missing")
    return int(text)


def read_common(root: str, flag: str = "--load") -> dict:
    """The common (non-sharded) state of the latest checkpoint under `root`; reads one file."""
    path = checkpoint_dir(root, latest_iteration(root, flag))
    from megatron.core.dist_checkpointing import load_common_state_dict

    return load_common_state_dict(str(path))["common"]


def capture_rng_state() -> dict:
    """This rank's RNG streams: Python, NumPy, torch (CPU and CUDA), megatron-core's tracker."""
    import random

    import numpy as np
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": get_cuda_rng_tracker().get_states(),
    }


def restore_rng_state(state: dict) -> None:
    import random

    import numpy as np
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _sharded(module, tp_rank: int, tp: int, replica: int, full_shapes: dict, optimizer=None):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    out = {}
    names, gated = canonical_names(module), gated_names(module)
    state = optimizer.optimizer.state if optimizer is not None else {}
    for local, p in module.named_parameters():
        name = names[local]
        shape = full_shapes[name]
        dim = split_dim(torch.Size(shape), p.shape, tp)
        tensors = {"model": p.data}
        if name in gated:  # [gate_r; up_r] is the dim-1 piece r of the [2, n, ...] view
            dim = 1 if dim is not None else None
            tensors = {"model": gated_view(p.data)}
        st = state.get(p, {})
        for k in ("exp_avg", "exp_avg_sq"):
            if k in st:
                tensors[f"optimizer.{k}"] = gated_view(st[k]) if name in gated else st[k]
        for kind, t in tensors.items():
            key = f"{kind}.{name}"
            if dim is None:
                rid = (tp_rank, replica)
                out[key] = ShardedTensor.from_rank_offsets(key, t, replica_id=rid)
            else:
                out[key] = ShardedTensor.from_rank_offsets(
                    key, t, (dim, tp_rank, tp), replica_id=replica
                )
    return out


def sharded_state(parts, full_shapes: dict, optimizer=None) -> dict:
    """`parts`: (module or None, TP rank, TP size, replica id) for everything this rank holds."""
    out = {}
    for module, tp_rank, tp, replica in parts:
        if module is not None:
            out.update(_sharded(module, tp_rank, tp, replica, full_shapes, optimizer))
    return out


def rank_objects(objects: dict[str, tuple[object, int, int]]) -> dict:
    """Per-replica state (e.g. a coreset selector's RNG and moments) as ShardedObjects:
    name -> (state, replica index, number of replicas)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return {
        name: ShardedObject(name, obj, (count,), (index,), replica_id=0)
        for name, (obj, index, count) in objects.items()
    }


def save(
    root: str,
    iteration: int,
    parts,
    full_shapes: dict,
    optimizer,
    common: dict,
    objects: dict | None = None,
) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    path = checkpoint_dir(root, iteration)
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = sharded_state(parts, full_shapes, optimizer)
    state.update(rank_objects(objects or {}))
    state["common"] = common
    dist_checkpointing.save(state, str(path))
    dist.barrier()
    if dist.get_rank() == 0:  # the tracker last: a half-written checkpoint is never "latest"
        tmp = Path(root) / (TRACKER + ".tmp")
        tmp.write_text(str(iteration))
        os.replace(tmp, Path(root) / TRACKER)
    dist.barrier()


def load(root: str, parts, full_shapes: dict, optimizer, objects: dict | None = None) -> dict:
    """Load into the modules (and optimizer moments); returns the common state, with the
    requested per-replica `objects` (name -> (None, index, count)) under "objects". A model-only
    checkpoint loads the weights alone (no moments, no objects)."""
    from megatron.core import dist_checkpointing

    iteration = latest_iteration(root)
    if read_common(root).get("model_only"):
        optimizer, objects = None, None
    if optimizer is not None:  # create the Adam moments so they can be loaded into
        for group in optimizer.optimizer.param_groups:
            for p in group["params"]:
                st = optimizer.optimizer.state[p]
                if "exp_avg" not in st:
                    st["step"] = torch.tensor(0.0)
                    st["exp_avg"] = torch.zeros_like(p)
                    st["exp_avg_sq"] = torch.zeros_like(p)
    state = sharded_state(parts, full_shapes, optimizer)
    wanted = rank_objects(objects or {})
    state.update(wanted)
    state["common"] = None
    loaded = dist_checkpointing.load(state, str(checkpoint_dir(root, iteration)))
    common = loaded.pop("common")
    common["objects"] = {name: loaded.pop(name) for name in wanted}
    with torch.no_grad():
        for key, sharded in state.items():
            if key != "common" and key not in wanted:
                sharded.data.copy_(loaded[key])
    if optimizer is not None:
        for group in optimizer.optimizer.param_groups:
            for p in group["params"]:
                optimizer.optimizer.state[p]["step"] = torch.tensor(float(common["iteration"]))
    return common
