"""The savable loader over a converted LLaVA energon dataset (`energon_llava.py`).

A task encoder attaches the cooker and turns energon's image decoding off, so the image members
reach the cooker as the bytes that were written (`IdsTaskEncoder` is the smallest such encoder)::

    from megatron.energon import Cooker, DefaultTaskEncoder, stateless

    class MyTaskEncoder(DefaultTaskEncoder):
        cookers = [Cooker(cook_llava)]
        decoder = None  # raw bytes: no decoding of .png/.jpg/.json members by energon

        @stateless
        def encode_sample(self, sample: LlavaRawSample): ...  # decode, tokenize, ...

        @stateless
        def batch(self, samples): ...

`open_loader` builds energon's savable loader for one data-parallel rank; `loader_state` and
`restore_loader` are what a checkpoint stores and reloads per DP rank; `close_loader` ends its
worker processes.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml
from megatron.energon import Cooker, Sample, TaskEncoder, basic_sample_keys, edataclass, stateless

#: energon's description of the dataset: crude samples (a dict of the raw tar members per key),
#: tagged with the subflavor below so a cooker can be matched to them.
from megatron_mllm.data.energon_llava import (
    _IMAGE_PART,
    SPLITS,
    _read_split,
    check_energon_dataset,
    check_has_validation,
)
from megatron_mllm.data.llava import (
    LlavaRecord,
)
from megatron_mllm.errors import ConfigError


@edataclass
class LlavaRawSample(Sample):
    """One record as energon delivers it to a task encoder: the checked record, each image's
    original encoded bytes (PNG, JPEG, ...) in placeholder order, and the record's source."""

    record: LlavaRecord
    image_bytes: list[bytes]
    source: str | None


# Samples this loader worker skipped since its last batch (each worker process has its own);
# the next batch carries them to the training process, which counts them.
_CORRUPTED: list[str] = []


def skip_corrupted(key: str, sources, err: BaseException):
    """Skip a sample whose members do not decode, noting it (its shard, from energon's source
    info, where it has one) for the next batch (energon's SkipSample: no traceback; the
    training process counts and names it)."""
    from megatron.energon import SkipSample

    shard = next((s.shard_name for s in sources or () if getattr(s, "shard_name", None)), None)
    why = str(err).splitlines()[0][:80] if str(err) else type(err).__name__
    where = f"sample {key}" + (f" of shard {shard}" if shard else "")
    _CORRUPTED.append(f"{where} ({type(err).__name__}: {why})")
    raise SkipSample()


@stateless
def cook_llava(sample: dict) -> LlavaRawSample:
    """energon's crude sample (the raw members of one key, with `decoder = None` on the task
    encoder) as a LlavaRawSample. Use as `cookers = [Cooker(cook_llava)]`."""
    meta = sample["json"]
    if isinstance(meta, (bytes, bytearray)):
        try:
            meta = json.loads(meta)
        except ValueError as err:  # UnicodeDecodeError and JSONDecodeError alike
            skip_corrupted(sample["__key__"], sample.get("__sources__"), err)
    record = LlavaRecord(
        str(meta["id"]),
        tuple(meta["images"]),
        tuple((str(role), str(text)) for role, text in meta["turns"]),
    )
    parts = {}
    for part, value in sample.items():
        m = _IMAGE_PART.match(part)
        if m:
            if not isinstance(value, (bytes, bytearray)):
                raise TypeError(
                    f"sample {sample['__key__']}: image {part} was decoded by energon; set "
                    "`decoder = None` on the task encoder to get the original bytes"
                )
            parts[int(m.group(1))] = bytes(value)
    if sorted(parts) != list(range(len(record.images))):
        raise ValueError(
            f"sample {sample['__key__']}: {len(parts)} image member(s) for "
            f"{len(record.images)} image(s) in its record"
        )
    return LlavaRawSample(
        **basic_sample_keys(sample),
        record=record,
        image_bytes=[parts[j] for j in range(len(parts))],
        source=meta.get("source"),
    )


class IdsTaskEncoder(TaskEncoder):
    """The smallest task encoder over our datasets: cooks with `cook_llava`, keeps the images
    undecoded, and batches to the list of record ids (for tests and inspection)."""

    cookers = [Cooker(cook_llava)]
    decoder = None

    @stateless
    def batch(self, samples: list[LlavaRawSample]) -> list[str]:
        return [s.record.id for s in samples]


def _split_config(path: str | Path, exclude: tuple[str, ...]) -> str | None:
    """A copy of the data set's split.yaml that also excludes `exclude`, in a temporary file
    (the data set's folder is left as it is); None when nothing is excluded."""
    if not exclude:
        return None
    split = _read_split(path)
    split["exclude"] = sorted(set(split.get("exclude") or []) | set(exclude))
    fd, name = tempfile.mkstemp(prefix="megatron_mllm_split_", suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(split, f)
    return name


def open_loader(
    path: str | Path,
    split: str,
    task_encoder: TaskEncoder,
    *,
    dp_rank: int,
    dp_size: int,
    batch_size: int,
    num_workers: int,
    seed: int,
    shuffle_buffer_size: int | None = None,
    max_samples_per_sequence: int | None = None,
    epochs: int | None = None,
    exclude_shards: tuple[str, ...] = (),
    packing_buffer_size: int | None = None,
):
    """energon's savable loader over `split` of the dataset at `path`, for data-parallel rank
    `dp_rank` of `dp_size` (ranks read disjoint parts), batched by `task_encoder`.

    "train": shuffled (shards, slices of at most `max_samples_per_sequence` samples, and a
    `shuffle_buffer_size` sample buffer) deterministically from `seed`; endless unless `epochs`
    is given (then that many passes, after which iteration stops). "val": in order, one pass per
    `iter(loader)` (or `epochs` passes). Shards named in `exclude_shards` (`DataAccount.left_out`)
    are not read. `packing_buffer_size` (train only; a task encoder with energon's packing
    hooks, `PackingTaskEncoder`): samples are packed from buffers of that many. Call
    `close_loader` when done to end the workers."""
    from megatron.energon import RepeatDataset, WorkerConfig, get_savable_loader

    if split not in SPLITS:
        raise ConfigError(f"split {split!r}: give one of {', '.join(SPLITS)}")
    if epochs is not None and epochs < 1:
        raise ConfigError(f"epochs {epochs}: give a whole number >= 1, or None")
    check_energon_dataset(path)
    if split == "val":
        check_has_validation(path)
    worker_config = WorkerConfig(
        rank=dp_rank, world_size=dp_size, num_workers=num_workers, seed_offset=seed
    )
    common = dict(worker_config=worker_config, batch_size=batch_size, task_encoder=task_encoder)
    common["split_config"] = _split_config(path, exclude_shards)
    try:
        if split == "train":
            dataset = _train_dataset(
                path,
                common,
                shuffle_buffer_size,
                max_samples_per_sequence,
                epochs is None,
                packing_buffer_size,
            )
        else:
            from megatron.energon import get_val_dataset

            dataset = get_val_dataset(path, split_part="val", **common)
    finally:  # energon reads the split config once, as the dataset is built
        if common["split_config"] is not None:
            os.unlink(common["split_config"])
    if epochs is not None and epochs > 1:
        dataset = RepeatDataset(dataset, repeats=epochs, worker_config=worker_config)
    return get_savable_loader(dataset)


def _train_dataset(
    path, common: dict, shuffle_buffer_size, max_samples_per_sequence, repeat, packing_buffer_size
):
    from megatron.energon import get_train_dataset

    return get_train_dataset(
        path,
        split_part="train",
        shuffle_buffer_size=shuffle_buffer_size,
        max_samples_per_sequence=max_samples_per_sequence,
        repeat=repeat,
        packing_buffer_size=packing_buffer_size,
        **common,
    )


def loader_state(loader) -> Any:
    """What a checkpoint stores for this DP rank: the position of `loader` (every worker's
    shard, slice, shuffle-buffer and batching state and which worker is next) as plain data
    (`plain_state`: a checkpoint never unpickles a class); None before anything was read. Each
    DP rank saves its own."""
    return plain_state(loader.save_state_rank())


def restore_loader(loader, state: Any) -> None:
    """Put a freshly opened `loader` (same path, split, rank, sizes and seed as the one saved,
    not yet iterated) at the position `state` from `loader_state`; None means the start."""
    if getattr(loader, "_has_workers", False):
        raise RuntimeError("restore_loader: the loader was already iterated; open a fresh one")
    loader.restore_state_rank(state_of_plain(state))


def plain_state(obj: Any) -> Any:
    """energon's loader state as tensors, numbers, strings, lists and dicts: a dataclass as
    {"__class__": its name, "fields": ...}, a dict subclass (FlexState) likewise with its
    items, a dict or tuple tagged, a NumPy array as an int64 or float64 tensor and its dtype."""
    import dataclasses

    import numpy as np
    import torch

    if obj is None or isinstance(obj, (bool, int, float, str, bytes, torch.Tensor)):
        return obj
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        wide = np.float64 if obj.dtype.kind == "f" else np.int64
        return {"__ndarray__": torch.from_numpy(obj.astype(wide)), "dtype": str(obj.dtype)}
    name = f"{type(obj).__module__}.{type(obj).__qualname__}"
    if dataclasses.is_dataclass(obj):
        fields = {f.name: plain_state(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return {"__class__": name, "fields": fields}
    if isinstance(obj, dict):
        items = [[plain_state(k), plain_state(v)] for k, v in obj.items()]
        return {"__class__": name, "items": items} if type(obj) is not dict else {"__dict__": items}
    if isinstance(obj, tuple):
        return {"__tuple__": [plain_state(v) for v in obj]}
    if isinstance(obj, list):
        return [plain_state(v) for v in obj]
    raise TypeError(f"energon's loader state holds a {name}, which plain_state cannot write")


def state_of_plain(data: Any) -> Any:
    """`plain_state`'s inverse. Only energon's own classes are made (dataclasses and dict
    subclasses under megatron.energon, filled field by field without calling anything they
    define); any other name is refused in one line."""
    import numpy as np

    if isinstance(data, list):
        return [state_of_plain(v) for v in data]
    if not isinstance(data, dict):
        return data
    if "__ndarray__" in data:
        return data["__ndarray__"].numpy().astype(np.dtype(data["dtype"]))
    if "__tuple__" in data:
        return tuple(state_of_plain(v) for v in data["__tuple__"])
    if "__dict__" in data:
        return {state_of_plain(k): state_of_plain(v) for k, v in data["__dict__"]}
    cls = _energon_class(data.get("__class__"))
    if "items" in data:
        return cls({state_of_plain(k): state_of_plain(v) for k, v in data["items"]})
    obj = object.__new__(cls)
    for key, value in data["fields"].items():
        object.__setattr__(obj, key, state_of_plain(value))
    return obj


def _energon_class(name: Any) -> type:
    """An energon state class by its dotted name; ConfigError for anything else."""
    import dataclasses
    import importlib

    module, _, qual = str(name).rpartition(".")
    ok = module.startswith("megatron.energon.") and qual.isidentifier()
    cls = getattr(importlib.import_module(module), qual, None) if ok else None
    if not (isinstance(cls, type) and (dataclasses.is_dataclass(cls) or issubclass(cls, dict))):
        raise ConfigError(
            f"the checkpoint's data-loader state names {name!r}, not one of energon's state "
            "classes; refusing to build it"
        )
    return cls


def close_loader(loader) -> None:
    """End the worker processes of `loader` (energon keeps them alive between epochs). Take
    `loader_state` first if the position matters: iterating a closed loader starts over
    (from its start, or from the state it was restored to)."""
    epoch_iterator = getattr(loader, "_epoch_iterator", None)
    if epoch_iterator is not None:
        epoch_iterator.close()
        loader._epoch_iterator = None
    inner = getattr(loader, "_iterator", None)  # torch's persistent multi-process iterator
    if inner is not None:
        if hasattr(inner, "_shutdown_workers"):
            inner._shutdown_workers()
        loader._iterator = None
    loader._has_workers = False


class LlavaTaskEncoder(TaskEncoder):
    """Training's task encoder: cooks with `cook_llava`, encodes each record with
    `data.task_encoder.encode_record` (tokens, labels, images) and batches them into one
    `MicroBatch`."""

    cookers = [Cooker(cook_llava)]
    decoder = None

    def __init__(self, spec) -> None:
        super().__init__()
        self.spec = spec  # a data.task_encoder.EncodeSpec

    @stateless
    def encode_sample(self, sample: LlavaRawSample):
        from megatron_mllm.data.task_encoder import encode_record

        try:
            encoded = encode_record(sample.record, sample.image_bytes, self.spec)
        except (OSError, ValueError, SyntaxError) as err:  # what Pillow raises on bad bytes
            skip_corrupted(sample.__key__, sample.__sources__, err)
        if not self.spec.sources:
            return encoded
        return replace(encoded, sources=(self.spec.sources.index(sample.source),))

    @stateless
    def batch(self, samples: list):
        from megatron_mllm.data.batch import collate

        batch = collate(samples)
        skipped = tuple(_CORRUPTED)
        _CORRUPTED.clear()
        return replace(batch, corrupted=skipped) if skipped else batch


@edataclass
class EncodedSample(Sample):
    """An encoded record, or a packed row of them, as energon carries it between its packing
    stages (a Sample, so that energon can restore its packing buffer from restore keys)."""

    batch: Any  # a one-row data.batch.MicroBatch


class PackingTaskEncoder(LlavaTaskEncoder):
    """`LlavaTaskEncoder` with energon's packing hooks: each buffer of encoded (unpadded)
    samples is packed into rows of the sequence length, every sample in exactly one row
    (`pack_lengths`), and a row is `batch.pack` of its samples in reading order."""

    @stateless
    def encode_sample(self, sample: LlavaRawSample) -> EncodedSample:
        return EncodedSample.derive_from(sample, batch=super().encode_sample(sample))

    def select_samples_to_pack(self, samples: list[EncodedSample]) -> list[list[EncodedSample]]:
        lengths = [s.batch.tokens.shape[1] for s in samples]
        return [[samples[i] for i in row] for row in pack_lengths(lengths, self.spec.seq_length)]

    @stateless
    def pack_selected_samples(self, samples: list[EncodedSample]) -> EncodedSample:
        from megatron_mllm.data.batch import pack

        row = pack([s.batch for s in samples], self.spec.seq_length, self.spec.pad_id)
        return EncodedSample.derive_from(samples[0], batch=row)

    @stateless
    def batch(self, samples: list[EncodedSample]):
        return super().batch([s.batch for s in samples])


def pack_lengths(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` grouped into rows of at most `capacity` (first fit, longest
    first; each row in reading order, rows by their first sample): every index once."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fit = next((r for r, free in enumerate(room) if free >= lengths[i]), None)
        if fit is None:
            rows.append([i])
            room.append(capacity - lengths[i])
        else:
            rows[fit].append(i)
            room[fit] -= lengths[i]
    return sorted(sorted(row) for row in rows)
