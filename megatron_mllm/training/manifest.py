"""A checkpoint's manifest: every file's size and CRC-32, and the run it belongs to.

Written into iter_NNNNNNN/manifest.json after every rank finished its files and before the
tracker names the iteration (so a checkpoint named latest always has one). Each rank checksums
the files it wrote (`__<rank>_<bucket>.distcp`), rank 0 the shared ones; verifying splits the
files over the ranks the same way, before any process group, so a truncated or overwritten file
is one line naming it before any weight is read.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

from megatron_mllm.errors import ConfigError

MANIFEST = "manifest.json"
_CHUNK = 8 << 20


def checksum(path: Path) -> tuple[int, int]:
    """(size, CRC-32) of a file."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            crc, size = zlib.crc32(block, crc), size + len(block)
    return size, crc


def own_files(directory: Path, rank: int) -> list[Path]:
    """The files of a torch_dist checkpoint that `rank` wrote (rank 0: also the shared ones)."""
    mine = sorted(directory.glob(f"__{rank}_*.distcp"))
    if rank == 0:
        mine += [
            p for p in sorted(directory.iterdir()) if p.is_file() and not p.name.startswith("__")
        ]
    return [p for p in mine if p.name != MANIFEST and not p.name.endswith(".tmp")]


def entries(directory: Path, rank: int) -> dict[str, list[int]]:
    """This rank's share of the manifest: file name -> [size, crc]."""
    return {p.name: list(checksum(p)) for p in own_files(directory, rank)}


def write(directory: Path, shares: list[dict], run_id: str) -> None:
    """Rank 0: the manifest from every rank's share, written atomically."""
    files = {name: v for share in shares for name, v in share.items()}
    atomic_write(
        directory, MANIFEST, json.dumps({"run_id": run_id, "files": files}, sort_keys=True)
    )


def atomic_write(directory: Path, name: str, text: str) -> None:
    """`directory / name` replaced atomically: `text` goes into a fresh temporary file created
    inside `directory` (exclusively: never through a link), which is then renamed over the old
    file (a rename replaces a link itself, not what it points to)."""
    import tempfile

    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, directory / name)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read(directory: Path) -> dict | None:
    """The manifest of a checkpoint directory, or None if it has none."""
    path = directory / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        raise ConfigError(
            f"{path} is not a manifest (garbled); restore it or load another checkpoint"
        ) from None


def verify(directory: Path, rank: int = 0, world: int = 1) -> bool:
    """Check this rank's share (every `world`-th file) of the manifest's files; False if the
    checkpoint has no manifest. ConfigError naming the first file that is missing or differs."""
    manifest = read(directory)
    if manifest is None:
        return False
    names = sorted(manifest["files"])
    for name in names[rank::world]:
        size, crc = manifest["files"][name]
        path = directory / name
        if not path.is_file():
            raise ConfigError(
                f"checkpoint file {path} is missing; restore it or load another checkpoint"
            )
        got_size, got_crc = checksum(path)
        if got_size != size:
            raise ConfigError(
                f"checkpoint file {path} has {got_size} bytes, the manifest {size} (truncated or "
                "overwritten); restore it or load another checkpoint"
            )
        if got_crc != crc:
            raise ConfigError(
                f"checkpoint file {path} does not match its manifest checksum (corrupted); "
                "restore it or load another checkpoint"
            )
    return True
