"""One run per --save directory: an advisory lock (flock) on a file naming its holder.

Rank 0 takes it before any process group. The kernel releases a flock when its process ends,
however it ends (kill -9 included), so a lock is never stale: a run that finds the file
unlocked takes it, with a warning if the record names a process that did not release it
cleanly; a run that finds it locked is refused in one line naming the holder (host, pid, start
time). At a clean exit the holder empties the record, then the kernel drops the lock.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from megatron_mllm.errors import ConfigError

LOCK = "megatron_mllm.lock"
_held: dict[str, int] = {}  # lock path -> the open descriptor that holds it


def _record(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    try:
        return json.loads(os.read(fd, 4096) or b"{}")
    except ValueError:
        return {}


def _since(holder: dict) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))


def acquire(save: str) -> Path:
    """Take --save's lock for this process (held until it exits); ConfigError if another
    process holds it."""
    root = Path(save)
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK
    try:  # never through a link someone planted there
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as err:
        if path.is_symlink():
            raise ConfigError(
                f"--save {save}: {LOCK} is a symbolic link; a run writes its lock only as a "
                "plain file there: remove the link"
            ) from None
        raise ConfigError(f"--save {save}: cannot open its lock {path} ({err.strerror})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _record(fd)
        os.close(fd)
        raise ConfigError(
            f"--save {save} is in use by process {holder.get('pid')} on {holder.get('host')} "
            f"since {_since(holder)} (lock {path}); wait for that run or give another --save"
        ) from None
    before = _record(fd)
    if before.get("pid"):
        print(
            f"WARNING: --save {save}: taking over the lock of process {before['pid']} on "
            f"{before.get('host')} (started {_since(before)}), which ended without releasing it",
            file=sys.stderr,
        )
    me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me).encode(), 0)
    _held[str(path)] = fd
    atexit.register(release, path)
    return path


def release(path: Path) -> None:
    """Empty the record (a clean release) and drop the lock, if this process holds it."""
    fd = _held.pop(str(path), None)
    if fd is not None:
        os.ftruncate(fd, 0)
        os.close(fd)  # closing the descriptor drops the flock
