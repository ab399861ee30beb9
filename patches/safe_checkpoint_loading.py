"""Nothing in a checkpoint runs code when it is loaded.

TARGET: torch.distributed.checkpoint, which megatron-core's dist_checkpointing loads through:
`filesystem.FileSystemReader.read_metadata` reads `.metadata` with plain `pickle.load`, and
`default_planner.DefaultLoadPlanner.load_bytes` (megatron-core's MCoreLoadPlanner inherits it)
reads every non-tensor object (ShardedObject) with `torch.load(weights_only=False)`. A crafted
checkpoint could run any code on every rank that loads it.
CHECKED_ON: torch 2.13.0 with megatron-core 0.16.1 (the module attributes are looked up, so a
torch without them is refused at apply time rather than left unpatched).
WHY: `.metadata` is unpickled by a restricted unpickler that resolves only torch's checkpoint
metadata classes, torch.Size, dtypes, layouts and memory formats; objects are loaded with
`torch.load(weights_only=True)` (tensors, numbers, strings, lists, tuples, dicts), so our own
objects are stored as such plain data (training/checkpointing.py, data/energon_llava.py). A
refusal is a ConfigError naming the file or object. On every device.
"""

from __future__ import annotations

import io
import pickle
import re
import types

import torch

ALLOWED = {
    "torch.distributed.checkpoint.metadata": None,  # every class of the metadata module
    "torch.distributed.checkpoint.planner": {
        "SavePlan",
        "WriteItem",
        "WriteItemType",
        "TensorWriteData",
        "LoadPlan",
        "ReadItem",
        "LoadItemType",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
}
# What our refusals say, to find them inside the CheckpointException torch wraps them in.
REFUSED = "(refused: unpickling it could run code)"
REFUSAL = re.compile(r"checkpoint (?:metadata|object) [^\n]*?" + re.escape(REFUSED))


class RefusedObject(pickle.UnpicklingError):
    """A pickle asked for something outside the allow-list."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        allowed = ALLOWED.get(module, ())
        if module == "torch":
            value = getattr(torch, name, None)
            if name == "Size" or isinstance(
                value, (torch.dtype, torch.layout, torch.memory_format)
            ):
                return value
        elif allowed is None or name in allowed:
            return super().find_class(module, name)
        raise RefusedObject(f"{module}.{name}")


def restricted_load(file) -> object:
    """Unpickle checkpoint metadata, resolving only ALLOWED names."""
    return _MetadataUnpickler(file).load()


def safe_object_load(value: io.BytesIO, what: str) -> object:
    """A checkpoint object as plain data (weights_only); ConfigError naming `what` otherwise."""
    from megatron_mllm.errors import ConfigError

    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as err:
        first = str(err).splitlines()[-1][:160] if str(err) else type(err).__name__
        raise ConfigError(
            f"checkpoint object {what} is not plain data ({first}); load only checkpoints "
            f"megatron_mllm wrote {REFUSED}"
        ) from None


def refusal_in(err: BaseException) -> str | None:
    """Our refusal's line where `err` (torch's CheckpointException included) carries one."""
    found = REFUSAL.search(str(err))
    return found.group(0) if found else None


def apply() -> None:
    """Install the restricted metadata unpickler and the weights-only object loader."""
    from torch.distributed.checkpoint import default_planner, filesystem

    if not isinstance(getattr(filesystem, "pickle", None), (types.ModuleType, _PickleShim)):
        raise RuntimeError("torch.distributed.checkpoint.filesystem has no pickle to replace")
    filesystem.pickle = _PickleShim()
    default_planner.DefaultLoadPlanner.load_bytes = _load_bytes


class _PickleShim:
    """What torch's filesystem module calls `pickle`: dump as before, load restricted."""

    dump = staticmethod(pickle.dump)
    dumps = staticmethod(pickle.dumps)

    @staticmethod
    def load(file):
        from megatron_mllm.errors import ConfigError

        try:
            return restricted_load(file)
        except pickle.UnpicklingError as err:
            raise ConfigError(
                f"checkpoint metadata {getattr(file, 'name', '.metadata')} asks for {err}, which "
                f"checkpoint metadata never holds {REFUSED}"
            ) from None


def _load_bytes(self, read_item, value: io.BytesIO) -> None:
    """DefaultLoadPlanner.load_bytes, the object read as plain data."""
    from torch.distributed.checkpoint._traverse import set_element

    fqn = read_item.dest_index.fqn
    obj = safe_object_load(value, fqn)
    if self.flatten_state_dict:
        set_element(self.original_state_dict, self.mappings[fqn], obj)
    else:
        self.state_dict[fqn] = obj
