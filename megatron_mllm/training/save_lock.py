"""One run per --save directory: a lock file naming its holder (host, pid, start time).

Rank 0 takes it before any process group, with O_EXCL so two starting runs cannot both win, and
removes it when it exits. A lock whose process is gone (killed with -9, its host the same) is
taken over with a warning line; one held by a live process, or from another host (whose
processes we cannot see), is refused in one line naming the holder.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import time
from pathlib import Path

from megatron_mllm.errors import ConfigError

LOCK = "megatron_mllm.lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _holder(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _create(path: Path) -> bool:
    """Write our holder record into a new lock file; False if the file exists."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
    with os.fdopen(fd, "w") as f:
        json.dump(me, f)
    return True


def acquire(save: str) -> Path:
    """Take --save's lock for this process (released at exit); ConfigError if it is held."""
    root = Path(save)
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK
    for _ in range(2):  # once more after removing a stale lock
        if _create(path):
            atexit.register(release, path)
            return path
        held = _holder(path)
        host, pid = held.get("host"), held.get("pid")
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(held.get("started", 0)))
        if host == socket.gethostname() and isinstance(pid, int) and not _alive(pid):
            print(
                f"WARNING: --save {save}: taking over the lock of process {pid} (started "
                f"{since}), which is gone",
                file=sys.stderr,
            )
            path.unlink(missing_ok=True)
            continue
        raise ConfigError(
            f"--save {save} is in use by process {pid} on {host} since {since} (lock {path}); "
            "wait for that run, give another --save, or remove the lock if that run is gone"
        )
    raise ConfigError(f"--save {save}: another run took the lock {path} while we started")


def release(path: Path) -> None:
    """Remove the lock if this process holds it."""
    if (
        _holder(path).get("pid") == os.getpid()
        and _holder(path).get("host") == socket.gethostname()
    ):
        path.unlink(missing_ok=True)
