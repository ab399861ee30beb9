"""megatron-core LLaVAModel torch_dist checkpoints (Megatron-LM's multimodal example) <-> ours,
behind tools/convert_mcore_llava.py; the key table is `models/mcore_llava.py`.

Import reads only the checkpoint's tensor metadata (through the restricted unpickler of
`patches/safe_checkpoint_loading`) and its model tensors: the common state, where Megatron-LM
keeps its `args` Namespace, is never unpickled, so the architecture comes from pretrain_mllm's
own model flags and every tensor's shape is checked against it. Export writes the model as
megatron-core's own LLaVAModel saves it (`sharded_state_dict`, local layer specs), with plain
data only in its common state. Every check runs before a process group or an output file is
touched; nothing existing is overwritten.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from megatron_mllm.errors import ConfigError
from megatron_mllm.models import mcore_llava
from megatron_mllm.models.config import MLLMConfig
from megatron_mllm.training.checkpointing import TRACKER, checkpoint_dir

MODEL_PREFIXES = ("language_model.", "vision_model.", "vision_projection.")
RELEASE = "release"  # Megatron-LM's name for a converted (iteration-less) checkpoint


def llava_checkpoint_path(root: str) -> Path:
    """The folder the tracker under `root` names (iter_NNNNNNN or release)."""
    tracker = Path(root) / TRACKER
    text = tracker.read_text(errors="replace").strip() if tracker.is_file() else None
    if text is None:
        raise ConfigError(f"--load-dir {root}: no {TRACKER} there (not a Megatron checkpoint)")
    path = Path(root) / RELEASE if text == RELEASE else None
    if text.isdigit():
        path = checkpoint_dir(root, int(text))
    if path is not None and any(path.glob("mp_rank_*")):
        raise ConfigError(
            f"--load-dir {root}: {path.name} is a --ckpt-format torch checkpoint (mp_rank_* "
            "pickles); save it as torch_dist first (Megatron-LM's --ckpt-convert-format torch_dist)"
        )
    if path is None or not (path / ".metadata").is_file():
        raise ConfigError(
            f"--load-dir {root}: {TRACKER} says '{text[:40]}' but no torch_dist checkpoint is "
            "there (an iteration number or 'release' naming a folder with a .metadata file)"
        )
    return path


def read_model_tensors(root: str) -> dict[str, torch.Tensor]:
    """The LLaVAModel tensors of the checkpoint under `root`, whole, as float32; optimizer
    state and objects are left unread."""
    import megatron_mllm_patches.safe_checkpoint_loading as safe
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = llava_checkpoint_path(root)
    safe.apply()
    reader = FileSystemReader(str(path))
    metadata = reader.read_metadata()
    wanted = {
        key: meta
        for key, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata) and key.startswith(MODEL_PREFIXES)
    }
    if not wanted:
        raise ConfigError(
            f"--load-dir {root}: {path.name} holds no language_model.* / vision_model.* "
            "tensors; give a checkpoint megatron-core's LLaVAModel saved"
        )
    out = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in wanted.items()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        load(out, storage_reader=reader, no_dist=True)
    return {k: v.float() for k, v in out.items()}


def import_llava(load_dir: str, save_dir: str, cfg: MLLMConfig, args: dict) -> int:
    """A megatron-core LLaVAModel checkpoint -> <save_dir>/iter_0000000 (model only) of the
    model `cfg` (pretrain_mllm's `args` describe it); returns the tensors converted."""
    mcore_llava.check_mappable(cfg)
    _refuse_existing(save_dir, TRACKER)
    theirs = mcore_llava.unstack_layers(read_model_tensors(load_dir), cfg)
    canonical = mcore_llava.to_canonical(theirs, cfg)

    import torch.distributed as dist

    from megatron_mllm.models.weights import full_state, load_full_state
    from megatron_mllm.training import checkpointing
    from megatron_mllm.training.convert_hf import _one_rank_model

    encoder, backbone, parts = _one_rank_model(cfg)
    _check_shapes(canonical, full_state(encoder, backbone))  # before anything is written
    load_full_state(encoder, canonical, 0, 1)
    load_full_state(backbone, canonical, 0, 1)
    shapes = {k: tuple(v.shape) for k, v in full_state(encoder, backbone).items()}
    common = {"iteration": 0, "model_only": True, "args": args, "source": {"mcore_llava": load_dir}}
    checkpointing.save(save_dir, 0, parts, shapes, None, common)
    dist.destroy_process_group()
    return len(canonical)


def export_llava(load_dir: str, save_dir: str) -> MLLMConfig:
    """Our latest checkpoint under `load_dir` -> <save_dir>/release, as megatron-core's
    LLaVAModel saves its model (`sharded_state_dict`; common state: plain data)."""
    from megatron_mllm.training import checkpointing
    from megatron_mllm.training.model_args import checkpoint_model_config

    cfg = checkpoint_model_config(checkpointing.read_common(load_dir, "--load-dir"))
    mcore_llava.check_mappable(cfg)
    _refuse_existing(save_dir, TRACKER)

    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_mllm.models.weights import full_state
    from megatron_mllm.training.convert_hf import _one_rank_model

    encoder, backbone, parts = _one_rank_model(cfg)
    shapes = {k: tuple(v.shape) for k, v in full_state(encoder, backbone).items()}
    checkpointing.load(load_dir, parts, shapes, None)
    model = mcore_llava.build_llava_model(cfg, mpu_one_rank())
    model.load_state_dict(mcore_llava.from_canonical(full_state(encoder, backbone), cfg))
    out = Path(save_dir) / RELEASE
    out.mkdir(parents=True)
    state = {"model": model.sharded_state_dict(), "iteration": 0, "checkpoint_version": 3.0}
    dist_checkpointing.save(state, str(out))
    (Path(save_dir) / TRACKER).write_text(RELEASE)
    dist.destroy_process_group()
    return cfg


def mpu_one_rank():
    """megatron-core's global parallel state on this one-rank world (LLaVAModel's sharded
    state dict reads it) and its ProcessGroupCollection."""
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    if not ps.model_parallel_is_initialized():
        ps.destroy_global_memory_buffer()  # initialize_model_parallel makes its own
        ps.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    return ProcessGroupCollection.use_mpu_process_groups()


def _refuse_existing(save_dir: str, marker: str) -> None:
    if (Path(save_dir) / marker).exists() or (Path(save_dir) / RELEASE).exists():
        raise ConfigError(
            f"--save-dir {save_dir} already holds a checkpoint; choose an empty directory"
        )


def _check_shapes(canonical: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    missing = sorted(set(expected) - set(canonical))
    extra = sorted(set(canonical) - set(expected))
    if missing or extra:
        raise ConfigError(
            f"the checkpoint's tensors do not match the model the flags describe (missing "
            f"{missing[:2]}, unexpected {extra[:2]}); pass the flags it was trained with"
        )
    for name, tensor in expected.items():
        shape = tuple(tensor.shape)
        if tuple(canonical[name].shape) != tuple(shape):
            raise ConfigError(
                f"checkpoint tensor for {name} is {tuple(canonical[name].shape)} where the model "
                f"flags give {tuple(shape)}; pass the flags the checkpoint was trained with"
            )
