#!/usr/bin/env python
"""Benchmark: coreset B-from-2B against random B, stratified random B (the coreset's own
per-source budgets, random within each source) and 2B by gradient accumulation, one process,
every method from the same initial weights on the same pools (paired by seed); 2B in one batch
runs a few steps for its activation memory (the reference of "memory vs 2B").

Default task: a megatron-core GPT (2 layers, hidden 128) on the skewed mixture
(`bench_data.mixture.SKEWED_SOURCES`): one big source of additions, most of them from a table
of 16 easy sums and a third from 200 harder ones, and seven small fact/rule sources, sizes
spread 31x; the held-out set has 64 examples per source, so every source counts alike, as in
CoLM's setting where random batches under-represent the small sources. Other tasks (--model):
`llava` the tiny MLLM on LLaVA-format digit conversations (four equal sources), `mllm` the tiny
MLLM captioning digits, `gpt --mixture math` math topics + digit captions. --size wide widens
the LLM so that compute, not Python, dominates a step (for the step-time comparison).

Per method: held-out loss and exact-answer accuracy overall and per source, the paired 95%
intervals of the held-out loss against random B, stratified B and accumulation (overall and per
source), activation memory (bytes autograd saves for backward beyond the weights, or the
selection's own peak of live tensors if larger), step time with the selection and where it
goes (the forward, without gradients, of only the pool rows the selection scores, features,
facility location), and training time to reach the same seed's accumulation loss. Methods
`coreset_zo_proportional` (no small-source rule) and `coreset_lookahead` (selected one step
ahead) are the selection's variants in the default table; `coreset_exact` (exact features),
`coreset_exact_dense` (exact, every coordinate) and `coreset_zo_unnormalised` (no Adam-style
normalisation) join with --methods.

    python tools/bench_coreset.py [--quick] [--seeds 10] [--steps 600] [--methods M,...]
                                  [--size tiny|wide] [--model gpt|llava|mllm] [--json]
    python tools/bench_coreset.py --skip-quality --pipeline-steps 20 --repeats 3 --size wide
        [--pipeline-runs coreset,coreset_lookahead_searched,...] [--no-pipeline-replan]

The pipeline section (`coreset_pipeline.py`) re-plans every run after its warm-up step on the
unit times it measured (as --replan-after-iters 1), unless --no-pipeline-replan.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from coreset_pipeline import RUNS, check_runs

if TYPE_CHECKING:
    from bench_data.coreset_tasks import Task

warnings.filterwarnings("ignore", message=".*absl.*")

# Trained for quality, every seed (2B in one batch runs MEMORY_STEPS steps for its memory).
METHODS = (
    "random_B",
    "stratified_B",
    "2B_accumulation",
    "coreset_zo",
    "coreset_zo_proportional",  # ablation: no small-source rule (budgets in proportion)
    "coreset_lookahead",
)
# Measured with --methods only (the default stays within 20 minutes).
VARIANTS = ("coreset_exact", "coreset_exact_dense", "coreset_zo_unnormalised")


@dataclass(frozen=True)
class Selection:
    """A coreset method's selector: features, the small-source rule, Adam-style normalisation,
    and the coordinates kept per source (top-h; zeroth-order features have k = 16)."""

    features: str = "zo"
    keep_small: bool = True
    normalise: bool = True
    top_h: int = 32


SELECTIONS = {
    "coreset_zo": Selection(),
    "coreset_zo_proportional": Selection(keep_small=False),
    "coreset_zo_unnormalised": Selection(normalise=False),
    "coreset_lookahead": Selection(),  # selected one step ahead
    "coreset_exact": Selection(features="exact"),
    "coreset_exact_dense": Selection(features="exact", top_h=1 << 30),
}
BASELINES = ("random_B", "stratified_B", "2B_accumulation")
SELECTION_PARTS = ("pool_forward_s", "features_s", "facility_location_s", "forwarded_rows")
MEMORY_STEPS = 12
POOL_CHUNK = 2  # the pool's gradient-free forward: chunks of 2B rows (one forward per pool)


class SavedBytes:
    """Counts the bytes autograd saves for backward (activation memory) while active; tensors
    that share a storage with `model`'s parameters (weights saved for backward) are resident
    anyway and are not counted."""

    def __init__(self, model) -> None:
        import torch

        self.total = 0
        self._weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda x: x)

    def _pack(self, t):
        if t.untyped_storage().data_ptr() not in self._weights:
            self.total += t.numel() * t.element_size()
        return t

    def __enter__(self):
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


def live_bytes_mode():
    """A dispatch mode that tracks the bytes of the storages created inside it and still alive
    (each storage once, however many tensors view it), and their peak (`.peak`): the
    selection's own memory."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class LiveBytes(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.live = self.peak = 0
            self.holders: dict[int, int] = {}  # storage pointer -> tensors alive on it

        def _free(self, ptr: int, n: int) -> None:
            self.holders[ptr] -= 1
            if not self.holders[ptr]:
                del self.holders[ptr]
                self.live -= n

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            import torch

            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()
                    ptr, n = storage.data_ptr(), storage.nbytes()
                    if ptr not in self.holders:
                        self.holders[ptr] = 0
                        self.live += n
                    self.holders[ptr] += 1
                    weakref.finalize(t, self._free, ptr, n)
            self.peak = max(self.peak, self.live)
            return out

    return LiveBytes()


def timed_selector(config, how: Selection):
    """A CoresetSelector as `how` says, adding the time its features take to
    `.spent["features_s"]`."""
    from megatron_mllm.data.coreset import CoresetSelector, source_budgets

    class Timed(CoresetSelector):
        def features(self, *a, **kw):
            t0 = time.perf_counter()
            out = super().features(*a, **kw)
            self.spent["features_s"] += time.perf_counter() - t0
            return out

        def normalise(self, feats):
            return super().normalise(feats) if how.normalise else feats

        def budgets(self, source_ids):
            return source_budgets(source_ids, self.config.batch_size, keep_small=how.keep_small)

    selector = Timed(config)
    selector.spent = {"features_s": 0.0}
    return selector


def coreset_pick(task: Task, selector, model, pool, b: int, spent: dict):
    """The forward without gradients of the pool rows the selection scores (sources kept whole
    skip it), in chunks of `POOL_CHUNK` x B rows, then their features and the selection. A
    gradient-free forward keeps one layer's intermediates at a time, so even a chunk of 2B
    stays below the activations B's training step saves (the measured peak says so)."""
    import torch

    from megatron_mllm.data.sampler import VocabParallelReplay

    t0 = time.perf_counter()
    sources = task.sources[pool]
    scored = pool[selector.scored_rows(sources)]
    with torch.no_grad():
        parts = [task.hidden_of(model, chunk) for chunk in scored.split(POOL_CHUNK * b)]
    hidden = torch.cat([h for h, _ in parts]) if parts else None
    labels = torch.cat([lab for _, lab in parts]) if parts else None
    t1 = time.perf_counter()
    before = selector.spent["features_s"]
    picked = selector.select_scored(
        sources, VocabParallelReplay(), hidden, labels, task.weight_of(model)
    )
    t2 = time.perf_counter()
    features = selector.spent["features_s"] - before
    spent["pool_forward_s"] += t1 - t0
    spent["forwarded_rows"] += len(scored)
    spent["features_s"] += features
    spent["facility_location_s"] += t2 - t1 - features
    return pool[picked]


def batches_of(method, task, pool, b, gen, pick):
    """The step's training batches (index tensors) for `method`."""
    import torch

    from megatron_mllm.data.coreset import source_budgets

    if method == "random_B":
        return [pool[:b]]
    if method == "stratified_B":
        sources = task.sources[pool]
        chosen = []
        for s, k in source_budgets(sources, b).items():
            rows = (sources == s).nonzero().squeeze(1)
            chosen.append(rows[torch.randperm(len(rows), generator=gen)[:k]])
        return [pool[torch.cat(chosen)]]
    if method == "2B_batch":
        return [pool]
    if method == "2B_accumulation":
        return [pool[:b], pool[b:]]
    return [pick(pool)]


def train_one(args, task: Task, method: str, seed: int) -> dict:
    """One method, one seed: metrics, memory, step time and its parts, the held-out curve."""
    import torch

    from megatron_mllm.data.coreset import CoresetConfig
    from megatron_mllm.data.sampler import PoolSampler

    b = args.batch
    model = task.new_model(1000 + seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    decay = None
    if args.lr_decay_style == "cosine":  # to a tenth of --lr at the last step, as Megatron's
        decay = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.steps, args.lr / 10)
    sampler = iter(PoolSampler(task.n_train, 2 * b, seed=seed))
    gen = torch.Generator().manual_seed(seed)
    spent = dict.fromkeys(SELECTION_PARTS, 0.0)
    selector, pending = None, None
    lookahead = method == "coreset_lookahead"  # zeroth-order, selected one step ahead
    if method.startswith("coreset"):
        how = SELECTIONS[method]
        config = CoresetConfig(batch_size=b, features=how.features, top_h=how.top_h, seed=seed)
        selector = timed_selector(config, how)

    def pick(pool):
        return coreset_pick(task, selector, model, pool, b, spent)

    peak, times, curve, elapsed = 0, [], [], 0.0
    for step in range(args.steps):
        measure = step == 0  # memory on the first step, untimed (the mode costs time)
        mode = live_bytes_mode() if measure and selector is not None else None
        watched = mode or contextlib.nullcontext()
        t0 = time.perf_counter()
        with watched:
            batches = pending or batches_of(method, task, next(sampler), b, gen, pick)
        opt.zero_grad()
        for idx in batches:
            with SavedBytes(model) as saved:
                loss = task.loss_of(model, idx) / len(batches)
            peak = max(peak, saved.total)
            loss.backward()
        if lookahead:  # the next step's pool, chosen with this step's weights (before the update)
            with watched:
                pending = [pick(next(sampler))]
        if mode is not None:
            peak = max(peak, mode.peak)
        opt.step()
        if decay is not None:
            decay.step()
        dt = time.perf_counter() - t0
        if not measure:
            times.append(dt)
        elapsed += dt
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            curve.append((elapsed, task.evaluate(model)["heldout_loss"]))
    row = task.evaluate(model)
    row.update(peak_activation_bytes=peak, step_s=statistics.median(times), curve=curve)
    row.update({k: v / args.steps for k, v in spent.items()})  # per step (first one included)
    return row


def run(rank: int, world: int, args, seeds: list[int]) -> dict:
    """Every method x seed in `seeds`, rows by method in seed order (paired), and with seed 0
    2B in one batch for a few steps (its activation memory is the reference)."""
    from bench_data.coreset_tasks import TASKS

    from megatron_mllm.runtime.assembly.bootstrap import init_rank

    init_rank(rank, world, 0, 60.0)
    task = TASKS[args.model](args)
    results = {m: [] for m in args.methods}
    for seed in seeds:
        for method in args.methods:
            results[method].append(train_one(args, task, method, seed))
        print(f"seed {seed + 1}/{args.seeds} done", file=sys.stderr, flush=True)
    out = {"describe": task.describe, "sources": task.names, "results": results}
    if 0 in seeds:
        short = argparse.Namespace(**{**vars(args), "steps": MEMORY_STEPS})
        out["memory"] = train_one(short, task, "2B_batch", 0) | {"steps": MEMORY_STEPS}
    return out


def run_seeds(args) -> dict:
    """`run` over the seeds dealt to `args.workers` single-rank processes side by side; the
    rows merged back into seed order."""
    from concurrent.futures import ThreadPoolExecutor

    from megatron_mllm.runtime.assembly.launch import spawn

    dealt = [list(range(args.seeds))[w :: args.workers] for w in range(args.workers)]
    with ThreadPoolExecutor(len(dealt)) as threads:
        outs = list(threads.map(lambda s: spawn(run, 1, args, s, timeout_s=7200)[0], dealt))
    order = [seed for seeds in dealt for seed in seeds]
    merged = {**outs[0], "results": {}}
    for m in args.methods:
        rows = [row for out in outs for row in out["results"][m]]
        pairs = sorted(zip(order, rows, strict=True), key=lambda pair: pair[0])
        merged["results"][m] = [row for _, row in pairs]
    return merged


def time_to_target(curve, target: float) -> float | None:
    """Training seconds until the held-out loss first reaches `target` (None: never)."""
    return next((t for t, loss in curve if loss <= target), None)


def compare(rows, base_rows, value=lambda r: r["heldout_loss"]):
    """The paired 95% interval of value(row) - value(base row), seed by seed."""
    from paired_stats import paired_interval

    return paired_interval([value(r) for r in rows], [value(r) for r in base_rows])


def per_source(rows, base_rows, key: str) -> list:
    """Paired intervals per source of `key` ("source_loss" or "source_accuracy")."""
    return [compare(rows, base_rows, lambda r, c=c: r[key][c]) for c in range(len(rows[0][key]))]


def mean_row(rows) -> dict:
    """Means over seeds of every number, per-source lists element-wise; step time the median."""
    out = {}
    for key, first in rows[0].items():
        if key == "curve":
            continue
        if isinstance(first, list):
            out[key] = [statistics.fmean(r[key][c] for r in rows) for c in range(len(first))]
        elif key == "step_s":
            out[key] = statistics.median(r[key] for r in rows)
        else:
            vals = [r[key] for r in rows if r[key] is not None]
            out[key] = statistics.fmean(vals) if vals else None
    return out


def summarise(results: dict) -> dict:
    """Per method: means, time to accumulation's loss, paired intervals on held-out loss and
    accuracy (overall and per source) against random B, stratified B and accumulation."""
    base = {k: results[k] for k in BASELINES if k in results}
    acc = results["2B_accumulation"]
    for rows in results.values():
        for row, ref in zip(rows, acc, strict=True):
            row["time_to_accumulation_loss_s"] = time_to_target(row["curve"], ref["heldout_loss"])
    out = {}
    for m, rows in results.items():
        stat = mean_row(rows)
        stat["reached"] = sum(r["time_to_accumulation_loss_s"] is not None for r in rows)
        ratios = [r["step_s"] / a["step_s"] for r, a in zip(rows, acc, strict=True)]
        stat["step_vs_accumulation"] = [statistics.median(ratios), min(ratios), max(ratios)]
        stat["vs"] = {
            b: {
                "heldout_loss": compare(rows, brows),
                "heldout_accuracy": compare(rows, brows, lambda r: r["heldout_accuracy"]),
                "source_loss": per_source(rows, brows, "source_loss"),
                "source_accuracy": per_source(rows, brows, "source_accuracy"),
            }
            for b, brows in base.items()
            if b != m
        }
        out[m] = stat
    if "coreset_lookahead" in results and "coreset_zo" in results:
        out["lookahead_vs_same_step"] = {
            k: compare(results["coreset_lookahead"], results["coreset_zo"], lambda r, k=k: r[k])
            for k in ("heldout_loss", "heldout_accuracy")
        }
    return out


def print_table(args, describe: str, names: list[str], s: dict, memory: dict) -> None:
    acc = s["2B_accumulation"]["step_s"]
    print(
        f"{describe}; size {args.size}; B={args.batch}, pool 2B, {args.steps} steps, lr "
        f"{args.lr}, {args.seeds} seeds paired; a+-h: mean paired difference and its 95% "
        "interval (* excludes 0)"
    )
    print("step ms: the median over seeds of each seed's median step; vs accum: the median of "
          "the per-seed ratios (their min-max in the JSON)")  # fmt: skip
    print(f"{'method':<22}{'held-out loss':>14}{'vs random B':>18}{'vs stratified B':>18}"
          f"{'vs 2B accum':>18}{'accuracy':>9}{'mem vs 2B':>10}{'step ms':>9}{'vs accum':>9}"
          f"{'to accum loss':>14}")  # fmt: skip
    for m in args.methods:
        r = s[m]
        cells = "".join(
            f"{_ci(r['vs'][b]['heldout_loss']) if b in r['vs'] else '-':>18}" for b in BASELINES
        )
        reach = r["time_to_accumulation_loss_s"]
        reach = f"{reach:.1f}s ({r['reached']}/{args.seeds})" if reach else f"0/{args.seeds}"
        print(
            f"{m:<22}{r['heldout_loss']:>14.4f}{cells}{r['heldout_accuracy']:>9.3f}"
            f"{r['peak_activation_bytes'] / memory['peak_activation_bytes']:>9.2f}x"
            f"{1000 * r['step_s']:>9.1f}{r['step_vs_accumulation'][0]:>8.2f}x{reach:>14}"
        )
    step = memory["step_s"]
    print(f"2B in one batch (memory and step only, {memory['steps']} steps): step "
          f"{1000 * step:.1f} ms, {step / acc:.2f}x accumulation")  # fmt: skip
    print_sources(args, names, s)
    if "lookahead_vs_same_step" in s:
        loss, accu = s["lookahead_vs_same_step"].values()
        print(f"look-ahead - same-step selection (paired): held-out loss {_ci(loss)}, "
              f"accuracy {_ci(accu, 3)}")  # fmt: skip
    for m in args.methods:
        if m.startswith("coreset"):
            r = s[m]
            parts = ", ".join(
                f"{k[:-2].replace('_', ' ')} {1000 * r[k]:.1f}"
                for k in ("pool_forward_s", "features_s", "facility_location_s")
            )
            print(f"{m} selection per step (ms): {parts}; pool rows forwarded "
                  f"{r['forwarded_rows']:.1f} of {2 * args.batch}")  # fmt: skip


def print_sources(args, names: list[str], s: dict) -> None:
    """Per-source held-out loss (accuracy) per method, then the paired intervals per source."""
    width = max(15, *(len(n) + 2 for n in names))
    print("held-out loss (accuracy) per source, " + "sources biggest first")
    print(f"{'method':<24}" + "".join(f"{n:>{width}}" for n in names))
    for m in args.methods:
        r = s[m]
        print(f"{m:<24}" + "".join(
            f"{f'{lo:.3f} ({ac:.2f})':>{width}}"
            for lo, ac in zip(r["source_loss"], r["source_accuracy"], strict=True)
        ))  # fmt: skip
    for m, b in (("2B_accumulation", "random_B"), ("coreset_zo", "random_B"),
                 ("coreset_zo", "stratified_B"), ("coreset_zo", "2B_accumulation")):  # fmt: skip
        if m in s and b in s[m]["vs"]:
            cells = "".join(f"{_ci(c, 3):>{width}}" for c in s[m]["vs"][b]["source_loss"])
            print(f"paired, {m} - {b}:\n{'':<24}{cells}")


def _ci(c, digits: int = 4) -> str:
    return c.text(digits) + ("*" if c.excludes_zero() else " ")


QUICK = {"seeds": 3, "steps": 200, "methods": "random_B,stratified_B,2B_accumulation,coreset_zo"}


def parse_args(argv=None) -> argparse.Namespace:
    from megatron_mllm.errors import OneLineParser

    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", choices=["gpt", "llava", "mllm"], default="gpt")
    ap.add_argument("--mixture", choices=["skewed", "math"], default="skewed", help="--model gpt")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated")
    ap.add_argument("--size", choices=["tiny", "wide"], default="tiny")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument(
        "--workers", type=int, default=2,
        help="processes training seeds side by side (1 for step times free of the other's)",
    )  # fmt: skip
    ap.add_argument("--quick", action="store_true", help=f"a short check: {QUICK}")
    ap.add_argument("--batch", type=int, default=32, help="B (the pool holds 2B)")
    ap.add_argument("--examples", type=int, default=4000)
    ap.add_argument("--held-out", type=int, default=64, help="held-out examples per source")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--lr", type=float, help="default 1e-3 for gpt, 3e-3 for the MLLMs")
    ap.add_argument("--lr-decay-style", choices=["cosine", "constant"], default="cosine",
                    help="cosine: to a tenth of --lr at the last step")  # fmt: skip
    ap.add_argument(
        "--pipeline-steps",
        type=int,
        default=0,
        help="also time B, 2B accumulation, coreset and look-ahead on a 2-stage pipeline for "
        "this many steps (2 processes; 0: skip)",
    )
    ap.add_argument("--repeats", type=int, default=3, help="pipeline repeats")
    ap.add_argument(
        "--pipeline-runs",
        default=",".join(RUNS),
        help="comma-separated runs to time on the pipeline (fewer: each run's blocks come round "
        "sooner); coreset and a look-ahead at least",
    )
    ap.add_argument("--pipeline-batch", type=int, default=16, help="B on the pipeline")
    ap.add_argument(
        "--pipeline-replan",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="plan every run again (step, pool pass, merge) on the unit times its warm-up step "
        "measured, as --replan-after-iters 1 does (--no-pipeline-replan: the start-up plans)",
    )
    ap.add_argument("--pipeline-text", type=int, default=112, help="text tokens (pipeline)")
    ap.add_argument("--skip-quality", action="store_true", help="only the pipeline timing")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the tables")
    ap.add_argument("--json-out", help="also write the JSON to this file")
    args = ap.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    args.lr = args.lr or (1e-3 if args.model == "gpt" else 3e-3)
    args.methods = args.methods.split(",")
    unknown = [m for m in args.methods if m not in METHODS + VARIANTS]
    if unknown:
        known = ", ".join(METHODS + VARIANTS)
        ap.error(f"--methods: unknown {', '.join(unknown)}; choose from {known}")
    missing = [m for m in ("2B_accumulation", "coreset_zo") if m not in args.methods]
    if missing:
        ap.error(f"--methods must include {' and '.join(missing)} (the comparison's pair)")
    if args.steps < 2 or args.seeds < 2 or args.batch < 1 or args.eval_every < 1:
        ap.error("--steps and --seeds must be at least 2, --batch and --eval-every at least 1")
    args.pipeline_runs = args.pipeline_runs.split(",")
    if (problem := check_runs(args.pipeline_runs)) is not None:
        ap.error(problem)
    if args.pipeline_batch < 2 or args.pipeline_batch % 2:
        ap.error(f"--pipeline-batch {args.pipeline_batch} must be even (micro-batches of 2)")
    if not 1 <= args.workers <= args.seeds:
        ap.error(f"--workers {args.workers} must be between 1 and --seeds ({args.seeds})")
    if (
        args.repeats < 1
        or args.pipeline_steps < 0
        or (args.skip_quality and not args.pipeline_steps)
    ):
        ap.error("--pipeline-steps must be >= 0 (> 0 with --skip-quality), --repeats >= 1")
    return args


def json_summary(args, out: dict, s: dict, pipe) -> dict:
    """The issue's keys first, then every method's figures (intervals as [low, high])."""

    def plain(x):
        if hasattr(x, "low"):
            return [x.low, x.high]
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, list):
            return [plain(v) for v in x]
        return x

    z, a, mem = s["coreset_zo"], s["2B_accumulation"], out["memory"]["peak_activation_bytes"]
    keys = {
        "coreset_step_s": z["step_s"],
        "accumulation_step_s": a["step_s"],
        "coreset_heldout_loss": z["heldout_loss"],
        "accumulation_heldout_loss": a["heldout_loss"],
        "coreset_memory_vs_2b": z["peak_activation_bytes"] / mem,
        "coreset_step_vs_accumulation": z["step_vs_accumulation"],  # median, min, max
        "seeds": args.seeds,
    }
    for name in ("random_B", "stratified_B"):
        if name in s:
            short = name.split("_")[0]
            keys[f"{short}_heldout_loss"] = s[name]["heldout_loss"]
            keys[f"coreset_vs_{short}_ci"] = plain(z["vs"][name]["heldout_loss"])
    return {
        **keys,
        "coreset_vs_accumulation_ci": plain(z["vs"]["2B_accumulation"]["heldout_loss"]),
        "model": args.model, "mixture": args.mixture, "size": args.size, "steps": args.steps,
        "sources": out["sources"], "methods": plain(s), "memory_2b_batch": out["memory"],
        "pipeline": pipe,
    }  # fmt: skip


def _write_json(path: str | None, data: dict) -> None:
    """--json-out: `data` to `path` (nothing without one)."""
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=1)


def main(argv=None) -> int:
    args = parse_args(argv)
    from coreset_pipeline import pipeline_section, print_pipeline

    pipe = pipeline_section(args) if args.pipeline_steps else None
    if args.skip_quality:
        _write_json(args.json_out, {"pipeline": pipe})
        print(json.dumps({"pipeline": pipe}) if args.json else "", end="")
        if not args.json:
            print_pipeline(pipe)
        return 0
    out = run_seeds(args)
    s = summarise(out["results"])
    summary = json_summary(args, out, s, pipe)
    _write_json(args.json_out, summary)
    if args.json:
        print(json.dumps(summary))
        return 0
    print_table(args, out["describe"], out["sources"], s, out["memory"])
    if pipe is not None:
        print_pipeline(pipe)
    return 0


if __name__ == "__main__":
    sys.exit(main())
