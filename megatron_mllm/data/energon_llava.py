"""LLaVA-format conversations as a megatron-energon dataset: conversion, checks and statistics.

`convert_llava` checks every record and image of a LLaVA JSON/JSONL file first (see
`megatron_mllm.data.llava`), then writes WebDataset tar shards to a new folder OUT: each sample
is `<key>.json` (the record: {"id", "images", "turns", "source"}) plus `<key>.img<j>.<ext>` per
image, holding the file's original encoded bytes. Train and validation records go to separate
shards (`train-000000.tar`, ..., `val-000000.tar`, ...); energon's own preparation indexes them and
writes `.nv-meta/split.yaml` assigning them by name pattern to the splits "train" and "val", and
`.nv-meta/dataset.yaml` (`DATASET_YAML`) declares a crude dataset, which energon hands over
undecoded for a task encoder's cooker (`cook_llava`) to turn into `LlavaRawSample`s.

Reading it back (cooker, task encoders, the savable loader): `energon_loader.py`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from braceexpand import braceexpand

from megatron_mllm.data.llava import (
    DEFAULT_MAX_IMAGE_PIXELS,
    LlavaRecord,
    check_images,
    image_path,
    load_raw,
    parse_record,
)
from megatron_mllm.errors import ConfigError

#: energon's description of the dataset: crude samples (a dict of the raw tar members per key),
#: tagged with the subflavor below so a cooker can be matched to them.
DATASET_YAML = """\
__module__: megatron.energon
__class__: CrudeWebdataset
subflavors:
  format: megatron_mllm.llava
"""
SUBFLAVORS = {"format": "megatron_mllm.llava"}
SPLITS = ("train", "val")
STATS = ".nv-meta/megatron_mllm.json"  # ours beside energon's: encoder load, source counts
SIZE_SAMPLE = 4096  # records whose image sizes the stats keep (a native tower's planned load)
TOOL = "tools/llava_to_energon.py"
NO_SOURCE = ""  # the source count key of records without a "source" field

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")
_IMAGE_PART = re.compile(r"^img(\d+)\.[^.]+$")


# --- conversion -------------------------------------------------------------------------------


def sample_key(record_id: str, taken: set[str]) -> str:
    """A WebDataset key for `record_id`: letters, digits, `_` and `-` only (no dots: energon
    splits a member name at its first dot), at most 100 characters, not in `taken` (a numbered
    suffix tells apart ids that look alike); the key is added to `taken`."""
    base = _UNSAFE.sub("_", record_id).strip("_")[:100] or "record"
    if base.startswith("__"):
        base = "r" + base
    key, n = base, 1
    while key in taken:
        n += 1
        key = f"{base}_{n}"
    taken.add(key)
    return key


def _split(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Record indices shuffled with `seed`, cut into (train, val): round(n * val_fraction) for
    validation, at least 1 when val_fraction > 0 and n >= 2, and never all of them."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_val = round(n * val_fraction)
    if val_fraction > 0 and n >= 2:
        n_val = max(n_val, 1)
    n_val = min(n_val, n - 1)
    return order[n_val:], order[:n_val]


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o644, 0
    tar.addfile(info, io.BytesIO(data))


def _check_output(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(
            f"--output-dir {out}: exists and is not an empty folder; give a new output folder"
        )


def _check_arguments(shard_size: int, val_fraction: float) -> None:
    if not isinstance(shard_size, int) or shard_size < 1:
        raise ConfigError(f"--shard-size {shard_size}: give a whole number of records >= 1")
    if not 0 <= val_fraction < 1:
        raise ConfigError(f"--val-fraction {val_fraction}: give a fraction with 0 <= F < 1")


def convert_llava(
    json_path: str | Path,
    image_folder: str | Path,
    out_dir: str | Path,
    shard_size: int = 1000,
    val_fraction: float = 0.05,
    seed: int = 0,
    progress: bool = True,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
) -> dict[str, int]:
    """Write the LLaVA file `json_path` (images under `image_folder`) as an energon dataset in
    the new folder `out_dir` (see the module docstring); returns {"train", "val", "shards"}.

    Every record and image is checked before anything is written; the dataset is built in a
    sibling folder `OUT.partial-<pid>` and renamed to OUT only once complete (removed on any
    error), so OUT either does not appear or holds a whole dataset."""
    from tqdm import tqdm

    _check_arguments(shard_size, val_fraction)
    out, folder = Path(out_dir), Path(image_folder)
    _check_output(out)
    raw = load_raw(json_path)
    if not raw:
        raise ConfigError(f"{json_path}: no records; give a LLaVA file with at least one")
    records = [parse_record(r, i) for i, r in enumerate(raw)]
    sizes = SizeSample()
    for record in tqdm(records, desc="checking images", unit="rec", disable=not progress):
        sizes.add(check_images(record, folder, max_image_pixels))
    sources = [raw_record.get("source") for raw_record in raw]
    train, val = _split(len(records), val_fraction, seed)

    tmp = out.parent / f"{out.name}.partial-{os.getpid()}"
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        taken: set[str] = set()
        shards: list[str] = []
        bar = tqdm(total=len(records), desc="writing shards", unit="rec", disable=not progress)
        with bar:
            for split, indices in (("train", train), ("val", val)):
                for start in range(0, len(indices), shard_size):
                    name = f"{split}-{start // shard_size:06d}.tar"
                    with tarfile.open(tmp / name, "w") as tar:
                        for i in indices[start : start + shard_size]:
                            _write_sample(tar, records[i], sources[i], folder, taken)
                            bar.update()
                    shards.append(name)
        _prepare(tmp, shards, has_val=bool(val))
        load = sum(len(records[i].images) for i in train) / max(1, len(train))
        stats = {
            "train_samples": len(train),
            "images_per_sample": load,
            "record_image_sizes": sizes.kept,  # up to SIZE_SAMPLE records' (height, width)s
            "sources": _count_sources(sources[i] for i in train),
        }
        (tmp / STATS).write_text(json.dumps(stats) + "\n")
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"train": len(train), "val": len(val), "shards": len(shards)}


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished dataset to OUT; another conversion that filled OUT meanwhile is one
    line (this one's work is removed, theirs kept)."""
    try:
        if out.exists():
            out.rmdir()  # empty when checked at the start; fails if another wrote into it
        tmp.rename(out)
    except OSError:
        raise ConfigError(
            f"--output-dir {out}: another conversion wrote it while this one ran; this one's "
            "output was removed, give another --output-dir"
        ) from None


def _count_sources(sources) -> dict[str, int]:
    """Training records per "source" field; those without one under NO_SOURCE."""
    counts: dict[str, int] = {}
    for source in sources:
        key = NO_SOURCE if source is None else str(source)
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def _write_sample(
    tar: tarfile.TarFile, record: LlavaRecord, source: Any, folder: Path, taken: set[str]
) -> None:
    key = sample_key(record.id, taken)
    meta = {
        "id": record.id,
        "images": list(record.images),
        "turns": [list(turn) for turn in record.turns],
        "source": source,
    }
    _add(tar, f"{key}.json", json.dumps(meta, ensure_ascii=False).encode("utf-8"))
    for j, name in enumerate(record.images):
        ext = Path(name).suffix.lstrip(".").lower() or "img"
        _add(tar, f"{key}.img{j}.{ext}", image_path(record.id, folder, name).read_bytes())


def _prepare(root: Path, shards: list[str], has_val: bool) -> None:
    """energon's indexing of the shards, the split assignment by shard name, dataset.yaml."""
    from megatron.energon.flavors.webdataset import BaseWebdatasetFactory

    patterns = [("train", r"^train-[0-9]+\.tar$")]
    if has_val:
        patterns.append(("val", r"^val-[0-9]+\.tar$"))
    chatter = io.StringIO()  # energon prints "Saving info to ..." etc. to stdout
    try:
        with contextlib.redirect_stdout(chatter):
            BaseWebdatasetFactory.prepare_dataset(
                root, shards, split_parts_patterns=patterns, shuffle_seed=None, workers=1
            )
    except SystemExit:  # energon exits on duplicate keys, which sample_key rules out
        raise RuntimeError(f"energon refused the shards in {root}: {chatter.getvalue()}") from None
    (root / ".nv-meta" / "dataset.yaml").write_text(DATASET_YAML)


# --- reading ----------------------------------------------------------------------------------


def check_energon_dataset(path: str | Path) -> None:
    """Refuse, in one line, a `path` that is not a dataset written by `convert_llava`."""
    p = Path(path)
    hint = f"make one with `python {TOOL} --json FILE --image-folder DIR --output-dir {p}`"
    if not p.is_dir():
        what = "does not exist" if not p.exists() else "is not a folder"
        raise ConfigError(f"{p}: {what}; an energon LLaVA dataset is a folder; {hint}")
    meta = p / ".nv-meta" / "dataset.yaml"
    if not meta.is_file():
        raise ConfigError(f"{p}: not a prepared energon dataset (no .nv-meta/dataset.yaml); {hint}")
    if "CrudeWebdataset" not in meta.read_text() or SUBFLAVORS["format"] not in meta.read_text():
        raise ConfigError(f"{p}: an energon dataset, but not a LLaVA one of ours; {hint}")


def check_has_validation(path: str | Path) -> None:
    """Refuse, in one line, a dataset without a validation split."""
    if "val:" not in (Path(path) / ".nv-meta" / "split.yaml").read_text():
        raise ConfigError(f"{path}: has no validation split; convert again with --val-fraction > 0")


class SizeSample:
    """A uniform sample of up to SIZE_SAMPLE records' image sizes (reservoir sampling, seeded):
    each kept record is its images' (height, width) list (empty: text only)."""

    def __init__(self) -> None:
        self.kept: list[list[tuple[int, int]]] = []
        self.seen = 0
        self._rng = random.Random(0)

    def add(self, sizes: list[tuple[int, int]]) -> None:
        self.seen += 1
        if len(self.kept) < SIZE_SAMPLE:
            self.kept.append(sizes)
            return
        slot = self._rng.randrange(self.seen)
        if slot < SIZE_SAMPLE:
            self.kept[slot] = sizes


def record_image_sizes(path: str | Path) -> list[list[tuple[int, int]]] | None:
    """The records' image sizes `convert_llava` sampled (None: converted without them)."""
    stats = Path(path) / STATS
    kept = json.loads(stats.read_text()).get("record_image_sizes") if stats.is_file() else None
    return None if kept is None else [[(int(h), int(w)) for h, w in r] for r in kept]


def images_per_sample(path: str | Path) -> float:
    """The training split's mean images per sample (text-only samples count 0), written by
    `convert_llava`; 1.0 for a dataset converted without it."""
    stats = Path(path) / STATS
    return json.loads(stats.read_text())["images_per_sample"] if stats.is_file() else 1.0


def train_sources(path: str | Path) -> tuple[str, ...]:
    """The training split's source names (each record's "source" field), sorted: a sample's
    source id is its name's index. Refused in one line where a record has none, or where the
    data set was converted before sources were counted."""
    stats = Path(path) / STATS
    counts = json.loads(stats.read_text()).get("sources") if stats.is_file() else None
    if counts is None:
        raise ConfigError(
            f"--data-path {path}: converted without source counts; convert it again with "
            f"{TOOL} (the coreset's budgets are per source)"
        )
    if NO_SOURCE in counts:
        total = sum(counts.values())
        raise ConfigError(
            f"--data-path {path}: {counts[NO_SOURCE]} of {total} training records have no "
            '"source" field; give every record one (the coreset keeps a budget per source) '
            "and convert again"
        )
    return tuple(counts)


def validation_samples(path: str | Path, exclude_shards: tuple[str, ...] = ()) -> int:
    """How many samples the validation split holds (energon's index of the shards), less those
    of `exclude_shards`."""
    counts = json.loads((Path(path) / ".nv-meta" / ".info.json").read_text())["shard_counts"]
    return sum(
        n
        for name, n in counts.items()
        if Path(name).name.startswith("val-") and name not in exclude_shards
    )


def unreadable_samples(path: str | Path) -> dict[str, tuple[int, int]]:
    """Per shard in energon's index: (samples indexed, samples no longer readable), from each
    shard's sample offsets (its .tar.idx) against the file's size: a shard cut short after
    conversion loses the samples past its end (a missing one, or one that is not a tar, all)."""
    import numpy as np

    root = Path(path)
    counts = json.loads((root / ".nv-meta" / ".info.json").read_text())["shard_counts"]
    out = {}
    for name, n in counts.items():
        shard, index = root / name, root / (name + ".idx")
        if not shard.is_file() or not index.is_file():
            out[name] = (n, n)
            continue
        if not _starts_like_a_tar(shard):  # e.g. overwritten with other bytes
            out[name] = (n, n)
            continue
        ends = np.fromfile(index, dtype="<u8")[1 : n + 1]  # sample i ends where i + 1 starts
        out[name] = (n, int(n - np.count_nonzero(ends <= shard.stat().st_size)))
    return out


def _starts_like_a_tar(path: Path) -> bool:
    """The first 512-byte header carries the ustar magic (an empty file does not)."""
    with open(path, "rb") as f:
        header = f.read(512)
    return len(header) == 512 and header[257:262] == b"ustar"


@dataclass(frozen=True)
class DataAccount:
    """The shards a run leaves out of a data set and what that costs. energon (7.4.1) reads a
    shard by its index and stops the run at the first sample past the shard's end instead of
    skipping it, so a shard with unreadable samples is left out whole: `dropped` counts its
    readable samples too, and is what --max-skipped-samples-fraction bounds."""

    path: str
    shards: dict[str, tuple[int, int]]  # every indexed shard: (samples, unreadable samples)

    @property
    def left_out(self) -> tuple[str, ...]:
        return tuple(sorted(name for name, (_, lost) in self.shards.items() if lost))

    @property
    def dropped(self) -> int:
        return sum(self.shards[name][0] for name in self.left_out)

    @property
    def total(self) -> int:
        return sum(n for n, _ in self.shards.values())

    def summary(self) -> str:
        """One line: the shards left out (unreadable of indexed samples) and the share."""
        named = ", ".join(
            f"{name} ({self.shards[name][1]} of {self.shards[name][0]} unreadable)"
            for name in self.left_out[:3]
        )
        more = f" and {len(self.left_out) - 3} more" if len(self.left_out) > 3 else ""
        return (
            f"{len(self.left_out)} damaged shard(s): {named}{more}; leaving them out skips "
            f"{self.dropped} of {self.total} samples ({self.dropped / self.total:.1%})"
        )


def account_samples(path: str | Path, max_fraction: float) -> DataAccount:
    """Count the unreadable samples of the data set at `path` per shard (cut short, missing or
    not a tar since conversion) and refuse, in one line, to leave out more than `max_fraction`
    of its samples or every shard of a split."""
    account = DataAccount(str(path), unreadable_samples(path))
    if account.dropped > max_fraction * account.total:
        raise ConfigError(
            f"--data-path {path}: {account.summary()}, over --max-skipped-samples-fraction "
            f"{max_fraction:g}; restore the shards, convert the data again, or raise the fraction"
        )
    for name, patterns in _read_split(path)["split_parts"].items():
        shards = {shard for pattern in patterns for shard in braceexpand(pattern)}
        if shards and shards <= set(account.left_out):
            raise ConfigError(
                f"--data-path {path}: every {name} shard is damaged ({account.summary()}); "
                "restore the shards or convert the data again"
            )
    return account


def _read_split(path: str | Path) -> dict:
    """The data set's energon split assignment (`.nv-meta/split.yaml`)."""
    return yaml.safe_load((Path(path) / ".nv-meta" / "split.yaml").read_text())
