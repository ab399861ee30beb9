"""torch_dist checkpoints (megatron-core dist_checkpointing) keyed by canonical parameter names.

Every parameter (and its Adam moments) is saved as a ShardedTensor of its full, unsharded shape
with this rank's offsets, so a checkpoint written under one pair of plans loads under any other.
Layout: <save>/iter_0000100/ and <save>/latest_checkpointed_iteration.txt, which rank 0 writes
only after every rank finished the save (an interrupted save is never taken as the latest).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from megatron_mllm.errors import ConfigError
from megatron_mllm.models.weights import canonical_names, split_dim

TRACKER = "latest_checkpointed_iteration.txt"


def checkpoint_dir(root: str, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def latest_iteration(root: str) -> int:
    tracker = Path(root) / TRACKER
    if not tracker.is_file():
        raise ConfigError(
            f"--load {root}: no {TRACKER} there (no finished checkpoint); "
            "point --load at a --save directory of a run that saved"
        )
    text = tracker.read_text().strip()
    if not text.isdigit() or not checkpoint_dir(root, int(text)).is_dir():
        raise ConfigError(f"--load {root}: {TRACKER} says '{text}' but that checkpoint is missing")
    return int(text)


def _sharded(module, tp_rank: int, tp: int, replica: int, full_shapes: dict, optimizer=None):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    out = {}
    names = canonical_names(module)
    state = optimizer.optimizer.state if optimizer is not None else {}
    for local, p in module.named_parameters():
        name = names[local]
        shape = full_shapes[name]
        dim = split_dim(torch.Size(shape), p.shape, tp)
        tensors = {"model": p.data}
        st = state.get(p, {})
        for k in ("exp_avg", "exp_avg_sq"):
            if k in st:
                tensors[f"optimizer.{k}"] = st[k]
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
    requested per-replica `objects` (name -> (None, index, count)) under "objects"."""
    from megatron.core import dist_checkpointing

    iteration = latest_iteration(root)
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
