"""Freed host memory kept for reuse on a CPU-only rank, as CUDA's caching allocator keeps device
memory on a GPU.

With glibc's defaults a large block (above a threshold that grows to 32 MB) is mapped on
allocation and unmapped on free, and the heap's top is trimmed back to the system: the next step
faults the same memory in again, page by page. On this 2-core machine an Optimus step at the
benchmark's medium size faulted ~53,000 pages a rank (~200 MB) and a step on the Megatron schedule
60-2,300 (`tools/bench_host_artifacts.py --allocator` measures what it costs). A GPU run has
none of this: its tensors live in the caching allocator's pool. Applied once per process, before
the model is built; without glibc (another C library) nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
KEEP_BYTES = 1 << 30  # blocks up to 1 GiB come from the heap; the heap is never trimmed


def keep_freed_host_memory() -> bool:
    """Ask glibc to keep freed blocks in the heap (no unmapping, no trimming); True where it
    did, False where this process has no glibc `mallopt`."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    unmapped = mallopt(M_MMAP_THRESHOLD, KEEP_BYTES)
    trimmed = mallopt(M_TRIM_THRESHOLD, KEEP_BYTES)
    return bool(unmapped and trimmed)
