"""torch_dist checkpoints (megatron-core dist_checkpointing) keyed by canonical parameter names.

Every parameter (its fp32 value: the optimizer's main parameter under bf16) and its Adam moments
are saved as ShardedTensors of their full, unsharded shape with this rank's offsets, so a
checkpoint written under one pair of plans loads under any other, with or without the
distributed optimizer and under any DP size (optimizer_state.py assembles its shards).
Layout: <save>/iter_0000100/ (with manifest.json: every file's size and CRC-32, training/
manifest.py) and <save>/latest_checkpointed_iteration.txt, which rank 0 writes only after every
rank finished the save and the manifest is written (an interrupted save is never the latest).
A "model only" checkpoint (common["model_only"], e.g. converted from Hugging Face) holds weights
and no optimizer, scheduler or RNG state.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import torch
from megatron_mllm_patches import safe_checkpoint_loading

from megatron_mllm.errors import ConfigError, RunStopped
from megatron_mllm.models.weights import canonical_names, gated_names, gated_view, split_dim
from megatron_mllm.training import manifest, optimizer_state
from megatron_mllm.training.optimizer_state import MOMENTS

safe_checkpoint_loading.apply()  # every load below reads plain data only

TRACKER = "latest_checkpointed_iteration.txt"


def checkpoint_dir(root: str, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def tracked(root: str | Path) -> str | None:
    """What the tracker under `root` says (stripped), or None where there is none."""
    tracker = Path(root) / TRACKER
    return _tracker_text(tracker) if tracker.is_file() else None


def _tracker_text(tracker: Path) -> str:
    """The tracker's text; ConfigError in one line where it is not text."""
    try:
        return tracker.read_bytes().decode("ascii").strip()
    except UnicodeDecodeError:
        raise ConfigError(
            f"{tracker} is not an iteration number (binary bytes); write the number of the "
            "checkpoint to continue from into it, or remove it"
        ) from None


def latest_iteration(root: str, flag: str = "--load") -> int:
    tracker = Path(root) / TRACKER
    if not tracker.is_file():
        raise ConfigError(
            f"{flag} {root}: no {TRACKER} there (no finished checkpoint); "
            f"point {flag} at a --save directory of a run that saved"
        )
    text = _tracker_text(tracker)
    if not text.isdigit() or not checkpoint_dir(root, int(text)).is_dir():
        raise ConfigError(f"{flag} {root}: {TRACKER} says '{text}' but that checkpoint is missing")
    return int(text)


def read_common(root: str, flag: str = "--load") -> dict:
    """The common (non-sharded) state of the latest checkpoint under `root`; reads one file."""
    path = checkpoint_dir(root, latest_iteration(root, flag))
    with warnings.catch_warnings():  # megatron-core's "no Transformer Engine or Apex" on import
        warnings.simplefilter("ignore", UserWarning)
        from megatron.core.dist_checkpointing import load_common_state_dict

    import pickle

    try:  # torch.load's weights_only default: plain data only
        return load_common_state_dict(str(path))["common"]
    except pickle.UnpicklingError as err:
        why = str(err).splitlines()[-1] if str(err) else type(err).__name__
        raise ConfigError(
            f"{flag} {root}: {path.name}/common.pt is not plain data ({why}); refusing to "
            "unpickle it, as it could run code"
        ) from None


def plain_tensors(rank: int, world: int, path: str) -> dict:
    """Every tensor a torch_dist checkpoint directory holds, whole (for `launch.spawn` with
    one rank: it opens its own gloo group)."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing import load_plain_tensors

    dist.init_process_group("gloo", rank=rank, world_size=world)
    return dict(load_plain_tensors(path))


def capture_rng_state() -> dict:
    """This rank's RNG streams: Python, NumPy, torch (CPU and CUDA), megatron-core's tracker."""
    import random

    import numpy as np
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {  # plain data only (tuples, numbers, tensors): loaded with weights_only
        "random": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": get_cuda_rng_tracker().get_states(),
    }


def restore_rng_state(state: dict) -> None:
    import random

    import numpy as np
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["random"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state(
        (kind, np.asarray(keys, dtype=np.int64).astype(np.uint32), pos, has_gauss, gauss)
    )
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _value(p: torch.nn.Parameter, states: dict) -> torch.Tensor:
    """The fp32 tensor a checkpoint holds for `p`: the optimizer's main value, the parameter
    itself (fp32), or an fp32 copy (loaded into, then copied back by `load`)."""
    main = states.get(p, {}).get("main")
    if main is not None:
        return main
    return p.data if p.dtype == torch.float32 else p.data.float()


def _sharded(module, tp_rank: int, tp: int, replica: int, full_shapes: dict, states: dict):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    out, values = {}, {}
    names, gated = canonical_names(module), gated_names(module)
    for local, p in module.named_parameters():
        name = names[local]
        shape = full_shapes[name]
        dim = split_dim(torch.Size(shape), p.shape, tp)
        values[p] = _value(p, states)
        tensors = {"model": values[p]}
        tensors.update({f"optimizer.{k}": v for k, v in states.get(p, {}).items() if k in MOMENTS})
        if name in gated:  # [gate_r; up_r] is the dim-1 piece r of the [2, n, ...] view
            dim = 1 if dim is not None else None
            tensors = {k: gated_view(t) for k, t in tensors.items()}
        for kind, t in tensors.items():
            key = f"{kind}.{name}"
            if dim is None:
                rid = (tp_rank, replica)
                out[key] = ShardedTensor.from_rank_offsets(key, t, replica_id=rid)
            else:
                out[key] = ShardedTensor.from_rank_offsets(
                    key, t, (dim, tp_rank, tp), replica_id=replica
                )
    return out, values


def sharded_state(parts, full_shapes: dict, states: dict) -> tuple[dict, dict]:
    """`parts`: (module or None, TP rank, TP size, replica id) for everything this rank holds;
    `states`: optimizer_state.gather's. Returns the sharded tensors and, per parameter, the fp32
    tensor that stands for its value."""
    out, values = {}, {}
    for module, tp_rank, tp, replica in parts:
        if module is not None:
            sharded, held = _sharded(module, tp_rank, tp, replica, full_shapes, states)
            out.update(sharded)
            values.update(held)
    return out, values


def rank_objects(objects: dict[str, tuple]) -> dict:
    """Per-replica state (e.g. a coreset selector's RNG and moments) as ShardedObjects:
    name -> (state, replica index, number of replicas[, copy]); where several ranks hold the
    same object, `copy` numbers them (copy 0 writes it)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return {
        name: ShardedObject(name, obj, (count,), (index,), replica_id=copy[0] if copy else 0)
        for name, (obj, index, count, *copy) in objects.items()
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
        refuse_links(root, path)
        if path.exists():  # a save of this iteration that a kill cut short (never the latest)
            shutil.rmtree(path)
        path.mkdir(parents=True)
    dist.barrier()
    states = optimizer_state.gather(optimizer) if optimizer is not None else {}
    state, _ = sharded_state(parts, full_shapes, states)
    state.update(rank_objects(objects or {}))
    state["common"] = common
    try:
        dist_checkpointing.save(state, str(path))
        dist.barrier()
        shares = [None] * dist.get_world_size()
        dist.all_gather_object(shares, manifest.entries(path, dist.get_rank()))
        if dist.get_rank() == 0:
            manifest.write(path, shares, common.get("run_id", ""))
    except BaseException as err:  # torch's CheckpointException is a BaseException
        if isinstance(err, KeyboardInterrupt | SystemExit):
            raise
        need = _state_bytes(state) * dist.get_world_size()
        # torch reports a full disk as ENOSPC or as a short write ("unexpected pos"): either
        # way, a device left with less than the checkpoint's size is the cause
        full = _no_space(err) or shutil.disk_usage(root).free < need
        if dist.get_rank() == 0:
            shutil.rmtree(path, ignore_errors=True)  # a partial save must not keep the disk full
        if full:
            raise RunStopped(
                f"--save {root}: no space left on the device while saving iteration {iteration} "
                f"(about {need / 1e6:.0f} MB needed); the partial {path.name} was removed; free "
                "space or give another --save"
            ) from None
        raise RunStopped(
            f"--save {root}: saving iteration {iteration} failed ({_first_line(err)}); the "
            f"partial {path.name} was removed"
        ) from None
    if dist.get_rank() == 0:  # the tracker last: a half-written checkpoint is never "latest"
        write_tracker(root, iteration)
    dist.barrier()


def _first_line(err: BaseException) -> str:
    """The innermost message of `err` (torch's CheckpointException carries each rank's
    traceback: its last line is the error)."""
    lines = [x.strip() for x in str(err).splitlines() if x.strip()]
    return (lines[-1] if lines else type(err).__name__)[:200]


def _no_space(err: BaseException) -> bool:
    """Whether `err` (or what torch's CheckpointException wraps) is a full device."""
    import errno

    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        return True
    return "No space left on device" in str(err) or "[Errno 28]" in str(err)


def _state_bytes(state: dict) -> int:
    """About what a rank's share of a checkpoint takes on disk (its tensors)."""
    total = 0
    for value in state.values():
        data = getattr(value, "data", None)
        if isinstance(data, torch.Tensor):
            total += data.numel() * data.element_size()
    return total


def refuse_links(root: str | Path, path: Path) -> None:
    """A save writes nothing through a link planted in --save: its iteration folder and the
    tracker are refused in one line where they are links."""
    for p in (path, Path(root) / TRACKER):
        if p.is_symlink():
            raise ConfigError(
                f"--save {root}: {p.name} is a symbolic link; a save writes only plain files "
                "and folders there: remove the link"
            )


def write_tracker(root: str | Path, iteration: int) -> None:
    """The tracker, replaced atomically (`manifest.atomic_write`)."""
    manifest.atomic_write(Path(root), TRACKER, str(iteration))


def load(root: str, parts, full_shapes: dict, optimizer, objects: dict | None = None) -> dict:
    """Load into the modules (and optimizer state, whichever optimizer saved it); returns the
    common state, with the requested per-replica `objects` (name -> (None, index, count)) under
    "objects". A model-only checkpoint loads the weights alone (no moments, no objects)."""
    from megatron.core import dist_checkpointing

    iteration = latest_iteration(root)
    if read_common(root).get("model_only"):
        optimizer, objects = None, None
    states = optimizer_state.gather(optimizer) if optimizer is not None else {}
    state, values = sharded_state(parts, full_shapes, states)
    wanted = rank_objects(objects or {})
    state.update(wanted)
    state["common"] = None
    try:
        loaded = dist_checkpointing.load(state, str(checkpoint_dir(root, iteration)))
    except BaseException as err:  # torch's CheckpointException is a BaseException
        refusal = safe_checkpoint_loading.refusal_in(err)
        if refusal is None:
            raise
        raise ConfigError(f"--load {root}: {refusal}") from None
    common = loaded.pop("common")
    common["objects"] = {name: loaded.pop(name) for name in wanted}
    with torch.no_grad():
        for key, sharded in state.items():
            if key != "common" and key not in wanted:
                sharded.data.copy_(loaded[key])
        for p, value in values.items():
            if value is not p.data:  # a lower-precision model takes the loaded fp32 value
                p.data.copy_(value)
    if optimizer is not None:
        optimizer_state.scatter(optimizer, states, common["iteration"])
    return common
