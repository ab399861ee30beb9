#!/usr/bin/env python
"""Fault injection (a benchmark-style tool, not a test): N cycles of a 2-rank training run killed
with -9 at random points, each restarted with --load, against one uninterrupted run.

A cycle kills one random rank either inside a save (as soon as this cycle's new iteration
directory appears), inside a step (a random moment after a log line) or between steps (right at
a log line; at a save iteration that moment may fall into the save). At the end the chaotic run
is completed without a kill, and compared with the uninterrupted one: consumed samples at the
end (from the iteration reached: skipped or repeated data shows in the losses instead), every
logged loss of every cycle, and the final checkpoint's tensors bit for bit. Processes of a run
(watched while it runs) still alive 3 s after it ended are orphans.

    python tools/chaos_train.py [--cycles 20] [--train-iters 40] [--seed 0] [--json]

Prints one line: cycles, kills inside a save, samples redone (trained after the last
checkpoint, lost to the kill), samples lost, first differing iteration, orphans.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_mllm.runtime.assembly.launch import free_port, spawn  # noqa: E402
from megatron_mllm.training.checkpointing import TRACKER, plain_tensors, tracked  # noqa: E402

LINE = re.compile(
    r"iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+) \|.*?lm loss: ([0-9.E+-]+) \|"
)
GLOBAL_BATCH = 8


def command(save: Path, iters: int, resume: bool) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(free_port()), str(ROOT / "pretrain_mllm.py"),
        "--pipeline-model-parallel-size", "2", "--global-batch-size", str(GLOBAL_BATCH),
        "--train-iters", str(iters), "--lr", "1e-2", "--lr-decay-style", "constant",
        "--log-interval", "1", "--save", str(save), "--save-interval", "3",
        *(["--load", str(save)] if resume else []),
    ]  # fmt: skip


class Cycle:
    """One run: its log lines as they come, its processes, and a kill on a condition."""

    def __init__(self, save: Path, iters: int) -> None:
        self.save, self.started = save, time.time()
        self.proc = subprocess.Popen(
            command(save, iters, (save / TRACKER).exists()),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.lines: list[tuple[int, int, float]] = []  # (iteration, consumed, loss)
        self.seen: set[int] = set()  # every process that belonged to the run
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for text in self.proc.stdout:
            m = LINE.search(text)
            if m:
                self.lines.append((int(m[1]), int(m[2]), float(m[3])))

    def watch(self) -> None:
        try:
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                self.seen.add(p.pid)
        except psutil.NoSuchProcess:
            pass

    def ranks(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children()
        except psutil.NoSuchProcess:
            return []

    def kill_when(self, ready, timeout: float = 120.0) -> bool:
        """SIGKILL one random rank once `ready()` holds; False if the run ended first."""
        deadline = time.time() + timeout
        while self.proc.poll() is None and time.time() < deadline:
            self.watch()
            if ready():
                ranks = self.ranks()
                if ranks:
                    random.choice(ranks).send_signal(signal.SIGKILL)
                    return True
            time.sleep(0.01)
        return False

    def finish(self) -> list[int]:
        """Wait for the run to end (watching its processes); the pids of its helpers still
        alive a while after."""
        deadline = time.time() + 300
        while self.proc.poll() is None and time.time() < deadline:
            self.watch()
            time.sleep(0.05)
        self.proc.wait(timeout=10)
        self.reader.join(timeout=10)
        time.sleep(3)
        return [pid for pid in self.seen if _alive(pid)]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def tracked_iteration(save: Path) -> int:
    """The iteration the tracker names (0 before the first checkpoint)."""
    return int(tracked(save) or 0)


def saving(cycle: Cycle):
    """True while this cycle's save is under way: an iteration directory newer than the
    tracker, made after the cycle started (not one a kill left behind)."""

    def check() -> bool:
        done = tracked_iteration(cycle.save)
        return any(
            int(d.name[5:]) > done and d.stat().st_mtime > cycle.started
            for d in cycle.save.glob("iter_*")
        )

    return check


def kill_condition(kind: str, cycle: Cycle, rng: random.Random):
    """When to kill: "save": a save is under way; "between": at the k-th log line; "step": a
    random 0-50 ms after it (inside the next step)."""
    if kind == "save":
        return saving(cycle)
    after, pause, mark = rng.randint(1, 4), rng.uniform(0.0, 0.05), []

    def ready() -> bool:
        if len(cycle.lines) < after:
            return False
        mark[:] = mark or [time.time()]
        return kind == "between" or time.time() - mark[0] >= pause

    return ready


def chaos(save: Path, cycles: int, iters: int, rng: random.Random) -> dict:
    kinds = {"save": 0, "step": 0, "between": 0}
    logged: list[tuple[int, int, float]] = []
    redone = orphans = 0
    for _ in range(cycles):
        cycle = Cycle(save, iters)
        kind = rng.choice(list(kinds))
        ready = kill_condition(kind, cycle, rng)
        killed = cycle.kill_when(ready)
        kinds[kind] += killed
        orphans += len(cycle.finish())
        logged += cycle.lines
        kept = tracked_iteration(save)
        last = max((it for it, _, _ in cycle.lines), default=0)
        redone += max(0, last - kept) * GLOBAL_BATCH
        if not killed:  # the run reached its end: nothing left to break
            break
    if tracked_iteration(save) < iters:  # complete it without a kill
        final = Cycle(save, iters)
        orphans += len(final.finish())
        logged += final.lines
    return {"kinds": kinds, "logged": logged, "redone": redone, "orphans": orphans}


def same_tensors(a: Path, b: Path) -> bool:
    """Both final checkpoints exist and hold the same tensors, bit for bit."""
    import torch

    if not (a / "manifest.json").exists() or not (b / "manifest.json").exists():
        return False
    x, y = (spawn(plain_tensors, 1, str(p))[0] for p in (a, b))
    return set(x) == set(y) and all(
        torch.equal(x[k], y[k]) for k in x if isinstance(x[k], torch.Tensor)
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--train-iters", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.cycles < 1 or args.train_iters < 4:
        print("error: give --cycles >= 1 and --train-iters >= 4", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    random.seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        straight = Cycle(Path(tmp) / "straight", args.train_iters)
        straight_orphans = len(straight.finish())
        result = chaos(Path(tmp) / "chaos", args.cycles, args.train_iters, rng)
        result["orphans"] += straight_orphans
        reference = {it: loss for it, _, loss in straight.lines}
        differ = sorted(it for it, _, loss in result["logged"] if reference.get(it) != loss)
        same = same_tensors(
            *(Path(tmp) / d / f"iter_{args.train_iters:07d}" for d in ("straight", "chaos"))
        )
        consumed = max((c for _, c, _ in result["logged"]), default=0)
        lost = args.train_iters * GLOBAL_BATCH - consumed
    kinds = result["kinds"]
    summary = {
        "cycles": sum(kinds.values()),
        "kills_inside_a_save": kinds["save"],
        "kills_inside_a_step": kinds["step"],
        "kills_between_steps": kinds["between"],
        "samples_redone": result["redone"],
        "samples_lost": lost,
        "first_differing_iteration": differ[0] if differ else None,
        "final_tensors_identical": same,
        "orphans": result["orphans"],
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"cycles {summary['cycles']} (kills inside a save {kinds['save']}, inside a step "
            f"{kinds['step']}, between steps {kinds['between']}) | samples redone after the "
            f"last checkpoint {result['redone']} | samples lost {lost} | first differing "
            f"iteration {summary['first_differing_iteration'] or 'none'} | final tensors "
            f"{'identical' if same else 'DIFFER'} | orphans {result['orphans']}"
        )
    return 0 if not differ and same and lost == 0 and result["orphans"] == 0 else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
