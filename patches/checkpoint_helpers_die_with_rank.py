"""dist_checkpointing's helper processes end when the rank that started them ends, also on
kill -9 of the rank.

TARGET: megatron/core/dist_checkpointing/strategies/filesystem_async.py:51
        _get_write_results_queue (a spawned multiprocessing Manager, kept for the process's
        life, whose server holds the resource tracker's pipe open) and :342
        FileSystemWriterAsync.write_preloaded_data (the target of the forked writer processes,
        one per write bucket, each save).
CHECKED_ON: megatron-core 0.16.1, torch 2.13.0, Linux.
WHY: when a rank is killed with -9 these helpers are reparented to init and keep running (the
Manager server for ever, a writer blocked on a full queue for ever, 200-300 MB each). Each now
asks the kernel for SIGKILL when its parent dies (prctl PR_SET_PDEATHSIG) before doing
anything else; the resource tracker then sees its pipe close and exits by itself. Without
prctl (not Linux) this patch does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import multiprocessing as mp
import signal
import sys
from multiprocessing.managers import SyncManager

TARGET = "megatron.core.dist_checkpointing.strategies.filesystem_async"
CHECKED_ON = ("0.16.1",)
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent ends (Linux; else nothing)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _results_queue_dying_with_rank():
    """filesystem_async's one results queue, served by a Manager that dies with the rank."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    if fa._results_queue is None:
        manager = SyncManager(ctx=mp.get_context("spawn"))
        manager.start(initializer=die_with_parent)
        fa._results_queue = manager.Queue()
    return fa._results_queue


def _dying_with_rank(write):
    @functools.wraps(write)
    def wrapper(*args, **kwargs):
        die_with_parent()
        return write(*args, **kwargs)

    wrapper.dies_with_parent = True
    return wrapper


def apply() -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    fa._get_write_results_queue = _results_queue_dying_with_rank
    writer = fa.FileSystemWriterAsync
    write = writer.__dict__["write_preloaded_data"].__func__
    if not getattr(write, "dies_with_parent", False):
        writer.write_preloaded_data = staticmethod(_dying_with_rank(write))
