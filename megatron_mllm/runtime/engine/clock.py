"""One timer for every span, unit time and step time the runtime reports.

On the CPU a mark is the host's `perf_counter`. On a GPU the host runs ahead of the device, so a
host clock would time kernel launches: a mark is a CUDA event recorded on the current stream,
and marks are read only after `finish()` synchronises once at step end. Code that times work
takes marks while it runs and converts them to seconds after `finish()`, never in between.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch


class StepClock:
    """Marks for one step on `device`; seconds are read after `finish()`."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.finished = False
        self.start = self.mark()

    def mark(self):
        """A point in time on the device's stream (a float on the CPU, an event on a GPU)."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def finish(self) -> None:
        """Wait for the device once (at step end); marks can be read from now on."""
        if self.cuda:
            torch.cuda.synchronize()
        self.finished = True

    def between(self, a, b) -> float:
        """Seconds from mark `a` to mark `b` (after `finish()`)."""
        if not self.finished:
            raise RuntimeError("StepClock marks are read after finish() (one sync per step)")
        if self.cuda:
            return a.elapsed_time(b) / 1000.0
        return b - a

    def since_start(self, m) -> float:
        """Seconds from the clock's start to mark `m` (after `finish()`)."""
        return self.between(self.start, m)


def median_seconds(
    fn: Callable[[], object],
    repeats: int,
    device: torch.device | str,
    before: Callable[[], object] | None = None,
) -> float:
    """The median device time of `fn` over `repeats` runs after one warm-up; `before` runs
    ahead of each, untimed (a barrier, so every rank starts a collective together)."""
    samples = []
    for i in range(repeats + 1):
        if before is not None:
            before()
        clock = StepClock(device)  # device time: CUDA events on a GPU
        fn()
        end = clock.mark()
        clock.finish()
        if i:  # the first run warms up
            samples.append(clock.since_start(end))
    return statistics.median(samples)


CPU_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
UNKNOWN_CACHE_BYTES = 2**25  # where neither the device nor sysfs says


def last_level_cache_bytes(device: torch.device | str, caches: Path = CPU_CACHES) -> int:
    """The device's last-level cache: a GPU's L2, else the host's highest cache level in sysfs
    (`caches`; `UNKNOWN_CACHE_BYTES` where neither says)."""
    if torch.device(device).type == "cuda":
        return int(
            getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
            or UNKNOWN_CACHE_BYTES
        )
    sizes = []
    for index in caches.glob("index*"):
        try:
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip()
            scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
            sizes.append((level, int(text.rstrip("KMG")) * scale))
        except (OSError, ValueError):
            continue
    return max(sizes)[1] if sizes else UNKNOWN_CACHE_BYTES


def cache_flusher(device: torch.device | str) -> Callable[[], object]:
    """A call that overwrites twice the device's last-level cache, for `median_seconds`'
    `before`: a unit timed after it starts cold, as it does in a step (after other units'
    weights and activations), not cache-hot from its own previous run."""
    buffer = torch.empty(2 * last_level_cache_bytes(device), dtype=torch.uint8, device=device)
    return lambda: buffer.fill_(1)
