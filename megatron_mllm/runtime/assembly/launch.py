"""Start one process per rank on this machine (gloo on CPU), run a function, gather results.

Each rank gets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT and one torch thread. A rank that
raises sends its one-line error back; `spawn` raises `RankFailed` naming every failed rank.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any


class RankFailed(RuntimeError):
    """One or more ranks failed; `errors` maps rank -> its error line, `tracebacks` rank -> the
    whole report the rank sent (its traceback), kept for diagnosis."""

    def __init__(self, errors: dict[int, str], tracebacks: dict[int, str] | None = None) -> None:
        self.errors = errors
        self.tracebacks = tracebacks or {}
        super().__init__("; ".join(f"rank {r}: {e}" for r, e in sorted(errors.items())))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank: int, world: int, port: int, args: tuple, queue) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)
    try:
        result = fn(rank, world, *args)
        buf = io.BytesIO()
        torch.save(result, buf)  # plain bytes: tensors must outlive this process
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException as err:  # noqa: BLE001 - every failure goes back to the parent
        line = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        queue.put((rank, "error", line + "\n" + traceback.format_exc()))
        queue.close()
        queue.join_thread()  # flush before the hard exit below
        os._exit(1)
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


# Imported once by the fork server that every rank process is forked from (not run: no process
# group, patch or RNG state exists there), so a rank starts in milliseconds instead of the
# seconds torch's and megatron-core's imports take.
PRELOAD = (
    "torch",
    "torch.distributed",
    "megatron.core",
    "megatron.core.pipeline_parallel",
    "megatron.core.distributed",
    "megatron.core.optimizer",
    "megatron.core.dist_checkpointing",
    "megatron_mllm.runtime.modes.runs",
    "megatron_mllm.runtime.modes.executor_run",
    "megatron_mllm.runtime.modes.megatron_baseline",
    "megatron_mllm.runtime.modes.reference",
    "megatron_mllm.training.train",
)


def _context():
    """Rank processes forked from one server that imported PRELOAD ("forkserver": the parent
    itself is never forked, so its threads and state stay out)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def spawn(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout_s: float = 600.0,
    allow_failures: bool = False,
) -> list[Any]:
    """Run `fn(rank, world, *args)` in `world` fresh processes; return results by rank."""
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(fn, r, world, port, args, queue), daemon=False)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    import queue as queue_mod
    import time

    deadline = time.monotonic() + timeout_s
    dead_since: dict[int, float] = {}
    while len(results) + len(errors) < world and time.monotonic() < deadline:
        try:
            rank, status, value = queue.get(timeout=0.2)
        except queue_mod.Empty:
            # A rank that died without a word (os._exit, a signal) is reported once its
            # process has been gone for a moment and nothing more is in the queue.
            now = time.monotonic()
            for r, p in enumerate(procs):
                if r in results or r in errors or p.exitcode is None:
                    continue
                if now - dead_since.setdefault(r, now) > 1.0:
                    errors[r] = f"process exited with code {p.exitcode} without a result"
            continue
        if status == "ok":
            import torch

            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
        else:
            errors[rank] = value
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    missing = [r for r in range(world) if r not in results and r not in errors]
    for r in missing:
        errors[r] = f"no result within {timeout_s:.0f} s (exit code {procs[r].exitcode})"
    if errors and not allow_failures:
        raise RankFailed({r: e.splitlines()[0] for r, e in errors.items()}, dict(errors))
    if allow_failures:
        return [results.get(r, errors.get(r)) for r in range(world)]
    return [results[r] for r in range(world)]
