"""LLaVA-format conversation records: reading, checking and the placeholder rule.

A file is a JSON list (or JSONL, one object a line) of records
`{"id": ..., "image": "a.jpg" | ["a.png", "b.jpg"] | absent, "conversations": [{"from":
"human" | "gpt" | "system", "value": "...<image>..."}, ...]}`, the images under one folder.
Where the text holds fewer `<image>` placeholders than the record has images, the missing ones
go at the start of the first human turn (LLaVA's rule); more placeholders than images, a missing
image or one that does not decode is an error naming the record and the file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from megatron_mllm.errors import ConfigError

IMAGE = "<image>"
ROLES = ("human", "gpt", "system")


@dataclass(frozen=True)
class LlavaRecord:
    """One conversation: its id, image files (relative to the image folder) in placeholder
    order, and its turns as (role, text) with exactly one `<image>` per image."""

    id: str
    images: tuple[str, ...]
    turns: tuple[tuple[str, str], ...]


def load_raw(path: str | Path) -> list[dict]:
    """The records of a LLaVA JSON (a list) or JSONL file, unchecked."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--json {p}: {'is a directory' if p.is_dir() else 'does not exist'}")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: not UTF-8 text (a LLaVA JSON or JSONL file)") from None
    if p.suffix == ".jsonl":
        raw = [
            _json_line(p, n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()
        ]
    else:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{p}: not JSON (line {err.lineno}: {err.msg})") from None
    if not isinstance(raw, list) or not all(isinstance(r, dict) for r in raw):
        raise ConfigError(f"{p}: expected a list of records ({{'id', 'conversations', ...}})")
    return raw


def _json_line(path: Path, lineno: int, line: str):
    """One JSONL record; ConfigError naming the file's line where it does not parse."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not JSON (line {lineno}: {err.msg})") from None


def parse_record(raw: dict, index: int) -> LlavaRecord:
    """A checked record with LLaVA's placeholder rule applied (see the module docstring)."""
    rid = str(raw.get("id", f"#{index}"))
    images = raw.get("image", [])
    images = [images] if isinstance(images, str) else images
    if not isinstance(images, list) or not all(isinstance(i, str) for i in images):
        raise ConfigError(f"record {rid}: 'image' must be a file name or a list of them")
    convs = raw.get("conversations")
    if not isinstance(convs, list) or not convs:
        raise ConfigError(f"record {rid}: no 'conversations' (a list of {{from, value}} turns)")
    turns = []
    for t in convs:
        role, value = (t.get("from"), t.get("value")) if isinstance(t, dict) else (None, None)
        if role not in ROLES or not isinstance(value, str):
            raise ConfigError(
                f"record {rid}: a turn from {role!r}; each turn needs 'from' in "
                f"{', '.join(ROLES)} and a string 'value'"
            )
        turns.append((role, value))
    placed = sum(v.count(IMAGE) for _, v in turns)
    if placed > len(images):
        raise ConfigError(
            f"record {rid}: {placed} {IMAGE} placeholders but {len(images)} image(s); "
            "give one image per placeholder"
        )
    if placed < len(images):
        first = next((i for i, (role, _) in enumerate(turns) if role == "human"), None)
        if first is None:
            raise ConfigError(f"record {rid}: images without a human turn to place them in")
        missing = (IMAGE + "\n") * (len(images) - placed)
        turns[first] = ("human", missing + turns[first][1])
    return LlavaRecord(rid, tuple(images), tuple(turns))


# Pillow's own default bound on an image's pixels (its decompression-bomb check).
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485


def image_path(record_id: str, folder: str | Path, name: str) -> Path:
    """The file image `name` of a record names, confined to `folder`: an absolute name, one with
    '..', or one whose links lead outside the folder is refused before the file system is
    asked whether it exists (the line is the same either way). Links that stay inside the
    folder are followed (data sets share files that way)."""
    root = Path(folder).resolve()
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts or not rel.parts:
        raise ConfigError(
            f"record {record_id}: image {name!r} is not a path inside --image-folder (absolute "
            "or with '..'); give it relative to the folder"
        )
    path = (root / rel).resolve()
    if not path.is_relative_to(root):
        raise ConfigError(
            f"record {record_id}: image {name!r} leads outside --image-folder through a "
            "link; copy the file into the folder"
        )
    return path


def check_images(
    record: LlavaRecord, folder: str | Path, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
) -> list[tuple[int, int]]:
    """Every image of `record` is a file inside `folder` (`image_path`) that decodes (JPEG,
    PNG, any size up to `max_pixels`); returns each one's (height, width)."""
    from PIL import Image

    bound, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None  # ours, from the header below
    try:
        return _check_record_images(record, folder, max_pixels)
    finally:
        Image.MAX_IMAGE_PIXELS = bound


def _check_record_images(
    record: LlavaRecord, folder: str | Path, max_pixels: int
) -> list[tuple[int, int]]:
    from PIL import Image, UnidentifiedImageError

    sizes = []
    for name in record.images:
        path = image_path(record.id, folder, name)
        if not path.is_file():
            raise ConfigError(f"record {record.id}: image {name!r} does not exist")
        try:
            with Image.open(path) as img:
                if img.width * img.height > max_pixels:
                    raise ConfigError(
                        f"record {record.id}: image {name!r} has {img.width}x{img.height} "
                        f"pixels, over --max-image-pixels {max_pixels}; resize it or raise the "
                        "bound"
                    )
                img.load()
                sizes.append((img.height, img.width))
        except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as err:
            why = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ConfigError(
                f"record {record.id}: image {name!r} does not decode ({why})"
            ) from None
    return sizes


def read_records(path: str | Path, folder: str | Path | None = None) -> list[LlavaRecord]:
    """Parse and check every record of a LLaVA file (and, given `folder`, its images)."""
    records = [parse_record(raw, i) for i, raw in enumerate(load_raw(path))]
    if folder is not None:
        for record in records:
            check_images(record, folder)
    return records
