#!/usr/bin/env python
"""Benchmark: coreset B-from-2B against random B, stratified random B, 2B in one batch and 2B by
gradient accumulation, one process, every method from the same initial weights on the same
pools (paired by seed).

Tasks (--model): `llava` (default) the tiny MLLM (ViT + projector + GPT from megatron-core
parts) on LLaVA-format conversations (tools' digit records: four sources, one to two images or
none, answers of a few tokens), encoded by the training path's own encoder; `mllm` the tiny
MLLM captioning scikit-learn's digits (sources = the ten classes, imbalanced); `gpt` a GPT on the
eight-source math + caption mixture. --size wide widens the LLM so that compute, not Python,
dominates a step (the table prints the overhead share).

Per method: held-out loss overall and on the worst source, exact-answer accuracy, activation
memory (bytes autograd saves for backward in the largest forward, or the selection's own peak
of live tensors if larger), step time with the selection and where it goes (pool forward in
chunks of B without gradients, features, facility location), training time to reach the same
seed's 2B-accumulation final held-out loss, and 95% intervals of the paired differences
against 2B accumulation.

    python tools/bench_coreset.py [--model llava|mllm|gpt] [--size tiny|wide] [--steps 150]
                                  [--seeds 5] [--json]
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
from dataclasses import asdict, dataclass, replace
from typing import Any

warnings.filterwarnings("ignore", message=".*absl.*")

METHODS = (
    "random_B",
    "stratified_B",
    "2B_batch",
    "2B_accumulation",
    "coreset_zo",
    "coreset_exact",
    "coreset_lookahead",
)
# The step-time comparison on a 2-stage pipeline (--pipeline-steps), its runs in step order.
PIPELINE_RUNS = ("B", "2B_accumulation", "coreset", "coreset_lookahead")
T975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}


class SavedBytes:
    """Counts the bytes autograd saves for backward (activation memory) while active."""

    def __init__(self) -> None:
        import torch

        self.total = 0
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda x: x)

    def _pack(self, t):
        self.total += t.numel() * t.element_size()
        return t

    def __enter__(self):
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


def live_bytes_mode():
    """A dispatch mode that tracks the bytes of tensors created inside it and still alive,
    and their peak (`.peak`): the selection's own memory."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class LiveBytes(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.live = self.peak = 0

        def _free(self, n: int) -> None:
            self.live -= n

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            import torch

            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and not t._is_view():
                    n = t.untyped_storage().nbytes()
                    self.live += n
                    weakref.finalize(t, self._free, n)
            self.peak = max(self.peak, self.live)
            return out

    return LiveBytes()


@dataclass
class Task:
    """What the training loop needs from a task: examples by index into one list."""

    n_train: int
    sources: Any  # [n_train] source id per training example
    new_model: Any  # seed -> model
    loss_of: Any  # (model, idx) -> mean training loss (with graph)
    evaluate: Any  # model -> held-out metrics
    hidden_of: Any  # (model, idx) -> (output-layer inputs [n, s, h], labels [n, s]), no graph
    weight_of: Any  # model -> output-layer weight [V, h]
    describe: str


def per_example_stats(logits, labels):
    """Per example: mean next-token loss over labelled positions and exact answer match."""
    import torch.nn.functional as F

    keep = labels != -100
    ce = F.cross_entropy(logits.transpose(1, 2), labels.clamp(min=0), reduction="none")
    loss = (ce * keep).sum(1) / keep.sum(1).clamp(min=1)
    exact = ((logits.argmax(-1) == labels) | ~keep).all(1).float()
    return loss, exact


def held_out_metrics(loss, exact, source, num_sources: int) -> dict:
    by = [(float(loss[source == c].mean()), float(exact[source == c].mean()))
          for c in range(num_sources) if (source == c).any()]  # fmt: skip
    return {
        "heldout_loss": float(loss.mean()),
        "worst_source_loss": max(b[0] for b in by),
        "heldout_accuracy": float(exact.mean()),
        "worst_source_accuracy": min(b[1] for b in by),
    }


def mllm_config(args, **kw):
    from megatron_mllm.models.config import MLLMConfig

    if args.size == "wide":
        kw.update(llm_layers=4, llm_hidden=256, llm_heads=8, vit_hidden=128)
    else:
        kw.update(llm_layers=2)
    return MLLMConfig(**kw)


def tiny_mllm(cfg):
    """ViT + projector + GPT from megatron-core parts, one process; forward(batch) -> logits
    [b, s, V], with the output layer's input captured when asked."""
    import torch

    from megatron_mllm.runtime.assembly.model_builder import build_full_model

    class TinyMLLM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            built = build_full_model(cfg)
            self.encoder, self.backbone = built.encoders[0], built.backbone

        def forward(self, batch):
            bb = self.backbone
            return bb(None, bb.decoder_input([self.encoder(batch.images)], batch), batch)

        def hidden(self, batch):
            captured = []
            out = self.backbone.gpt.output_layer
            handle = out.register_forward_pre_hook(
                lambda m, a: captured.append(a[0].transpose(0, 1).detach())
            )
            try:
                self(batch)
            finally:
                handle.remove()
            return captured[0]

    return TinyMLLM


def batch_task(args, cfg, batches, source, held, describe: str) -> Task:
    """A Task over one-sample MicroBatches `batches` (the held-out ones at indices `held`)."""
    import torch

    from megatron_mllm.data.batch import collate
    from megatron_mllm.runtime.assembly.bootstrap import seed_model_parallel

    model_class = tiny_mllm(cfg)
    held_set = set(held.tolist())
    train_rows = [i for i in range(len(batches)) if i not in held_set]
    train = [batches[i] for i in train_rows]

    def new_model(seed):
        torch.manual_seed(seed)
        seed_model_parallel(seed)
        return model_class()

    def loss_of(model, idx):
        batch = collate([train[i] for i in idx.tolist()])
        return per_example_stats(model(batch), batch.labels)[0].mean()

    @torch.no_grad()
    def evaluate(model):
        batch = collate([batches[i] for i in held.tolist()])
        loss, exact = per_example_stats(model(batch), batch.labels)
        return held_out_metrics(loss, exact, source[held], int(source.max()) + 1)

    def hidden_of(model, idx):
        batch = collate([train[i] for i in idx.tolist()])
        return model.hidden(batch), batch.labels

    return Task(
        len(train),
        source[train_rows],
        new_model,
        loss_of,
        evaluate,
        hidden_of,
        lambda model: model.backbone.gpt.output_layer.weight.detach(),
        describe,
    )


def llava_task(args) -> Task:
    """LLaVA-format digit conversations (four sources), encoded as training encodes them."""
    import tempfile
    from pathlib import Path

    import torch

    from megatron_mllm.data.llava import load_raw, read_records
    from megatron_mllm.data.llava_digits import conversation_texts, write_llava_digits
    from megatron_mllm.data.task_encoder import EncodeSpec, encode_record
    from megatron_mllm.data.tokenizer import load_tokenizer, train_tiny_tokenizer

    seq = 48
    with tempfile.TemporaryDirectory() as tmp:
        json_path = write_llava_digits(Path(tmp) / "src", args.examples)
        train_tiny_tokenizer(conversation_texts(json_path), Path(tmp) / "tok", 300)
        tokenizer = load_tokenizer(Path(tmp) / "tok")
        names = [r["source"] for r in load_raw(json_path)]
        records = read_records(json_path)
        folder = Path(json_path).parent / "images"
        probe = mllm_config(args)
        vocab = -(-len(tokenizer) // 128) * 128
        cfg = mllm_config(args, vocab_size=vocab, text_len=seq - probe.image_tokens)
        spec = EncodeSpec(tokenizer, seq, cfg.image_tokens, cfg.image_size)
        batches = [
            encode_record(r, [(folder / name).read_bytes() for name in r.images], spec)
            for r in records
        ]
    kinds = sorted(set(names))
    source = torch.tensor([kinds.index(n) for n in names])
    g = torch.Generator().manual_seed(0)
    held = torch.cat([
        (source == c).nonzero().squeeze(1)[torch.randperm(int((source == c).sum()), generator=g)][
            : args.held_out
        ]
        for c in range(len(kinds))
    ])  # fmt: skip
    describe = (
        f"LLaVA-format digit conversations ({', '.join(kinds)}), {len(batches) - len(held)} "
        f"training, {len(held)} held out; sequence {seq}, vocabulary {vocab}"
    )
    return batch_task(args, cfg, batches, source, held, describe)


def mllm_task(args) -> Task:
    """The tiny MLLM captioning scikit-learn's digits; source = digit class, ~1 / (class + 1)."""
    import tempfile

    import torch
    from bench_data.digit_shards import ImageCaptionShards, write_digit_shards

    from megatron_mllm.data.batch import image_then_text

    cfg = mllm_config(args, text_len=20)
    with tempfile.TemporaryDirectory() as tmp:
        write_digit_shards(tmp, energon=False)
        data = ImageCaptionShards(tmp)
    words = "zero one two three four five six seven eight nine".split()
    label = torch.tensor([words.index(c.split()[-1]) for c in data.captions])
    g = torch.Generator().manual_seed(0)
    keep, held = [], []
    for c in range(10):
        rows = (label == c).nonzero().squeeze(1)
        rows = rows[torch.randperm(len(rows), generator=g)]
        held += rows[: args.held_out].tolist()
        rest = rows[args.held_out :]
        keep += rest[: max(8, len(rest) // (c + 1))].tolist()  # a few big, several small
    rows = keep + held
    images, text = data.batch(rows, cfg.image_size, cfg.channels, cfg.text_len, cfg.vocab_size)
    batches = [
        image_then_text(images[i : i + 1], text[i : i + 1], cfg.num_patches)
        for i in range(len(rows))
    ]
    held_idx = torch.arange(len(keep), len(rows))
    describe = f"digit captions, 10 classes, {len(keep)} training, {len(held)} held out"
    return batch_task(args, cfg, batches, label[rows], held_idx, describe)


def gpt_task(args) -> Task:
    """A megatron-core GPT on the eight-source math + digit-caption mixture."""
    import torch
    from bench_data.mixture import VOCAB, build_mixture
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_mllm.data.batch import IGNORE_INDEX
    from megatron_mllm.models.config import transformer_config
    from megatron_mllm.models.stages import causal_mask
    from megatron_mllm.parallel.groups import build_colocated_groups
    from megatron_mllm.parallel.plans import ParallelPlan
    from megatron_mllm.runtime.assembly.bootstrap import seed_model_parallel

    one = ParallelPlan(1, 1, 1)
    groups = build_colocated_groups(one, one, 1, 0)
    seq = 32
    train, held = build_mixture(args.examples, seed=0, seq_len=seq)
    mask, pos = causal_mask(seq), torch.arange(seq).unsqueeze(0)
    cfg = mllm_config(args, vocab_size=len(VOCAB))

    def labels_of(data, idx):
        labels = torch.full_like(data.tokens[idx], IGNORE_INDEX)
        answer = data.answer_mask[idx][:, :-1].bool()
        labels[:, :-1] = torch.where(answer, data.tokens[idx][:, 1:], IGNORE_INDEX)
        return labels

    def new_model(seed):
        torch.manual_seed(seed)
        seed_model_parallel(seed)
        return GPTModel(
            transformer_config(cfg, "llm", 1, 1),
            get_gpt_layer_local_spec(),
            len(VOCAB),
            seq,
            pg_collection=groups.backbone,
            share_embeddings_and_output_weights=False,
            position_embedding_type="rope",
        )

    def logits(model, tokens):
        return model(tokens, pos.expand(tokens.shape[0], -1), mask)

    def loss_of(model, idx):
        return per_example_stats(logits(model, train.tokens[idx]), labels_of(train, idx))[0].mean()

    @torch.no_grad()
    def evaluate(model):
        every = torch.arange(len(held.tokens))
        loss, exact = per_example_stats(logits(model, held.tokens), labels_of(held, every))
        return held_out_metrics(loss, exact, held.source, len(held.names))

    def hidden_of(model, idx):
        captured = []
        handle = model.output_layer.register_forward_pre_hook(
            lambda m, a: captured.append(a[0].transpose(0, 1).detach())
        )
        try:
            logits(model, train.tokens[idx])
        finally:
            handle.remove()
        return captured[0], labels_of(train, idx)

    describe = f"math + caption mixture, 8 sources, {len(train.tokens)} training"
    return Task(
        len(train.tokens),
        train.source,
        new_model,
        loss_of,
        evaluate,
        hidden_of,
        lambda model: model.output_layer.weight.detach(),
        describe,
    )


def timed_selector(config):
    """A CoresetSelector that adds the time its features take to `.spent["features_s"]`."""
    from megatron_mllm.data.coreset import CoresetSelector

    class Timed(CoresetSelector):
        def features(self, *a, **kw):
            t0 = time.perf_counter()
            out = super().features(*a, **kw)
            self.spent["features_s"] += time.perf_counter() - t0
            return out

    selector = Timed(config)
    selector.spent = {"features_s": 0.0}
    return selector


def coreset_pick(task: Task, selector, model, pool, b: int, spent: dict):
    """The pool's forward in chunks of B without gradients, then features and selection."""
    import torch

    from megatron_mllm.data.sampler import VocabParallelReplay

    t0 = time.perf_counter()
    with torch.no_grad():
        parts = [task.hidden_of(model, chunk) for chunk in pool.split(b)]
    hidden = torch.cat([h for h, _ in parts])
    labels = torch.cat([lab for _, lab in parts])
    t1 = time.perf_counter()
    before = selector.spent["features_s"]
    picked = selector.select(
        task.sources[pool], VocabParallelReplay(), hidden, labels, task.weight_of(model)
    )
    t2 = time.perf_counter()
    features = selector.spent["features_s"] - before
    spent["pool_forward_s"] += t1 - t0
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
    sampler = iter(PoolSampler(task.n_train, 2 * b, seed=seed))
    gen = torch.Generator().manual_seed(seed)
    spent = dict.fromkeys(("pool_forward_s", "features_s", "facility_location_s"), 0.0)
    selector, pending = None, None
    lookahead = method == "coreset_lookahead"  # zeroth-order, selected one step ahead
    if method.startswith("coreset"):
        features = "zo" if lookahead else method.split("_")[1]
        selector = timed_selector(CoresetConfig(batch_size=b, features=features, seed=seed))

    def pick(pool):
        return coreset_pick(task, selector, model, pool, b, spent)

    peak, times, curve, elapsed = 0, [], [], 0.0
    for step in range(args.steps):
        measure = step == 0  # memory on the first step, untimed (the mode costs time)
        mode = live_bytes_mode() if measure and selector is not None else None
        t0 = time.perf_counter()
        with mode if mode is not None else contextlib.nullcontext():
            batches = pending or batches_of(method, task, next(sampler), b, gen, pick)
        opt.zero_grad()
        for idx in batches:
            with SavedBytes() as saved:
                loss = task.loss_of(model, idx) / len(batches)
            peak = max(peak, saved.total)
            loss.backward()
        if lookahead:  # the next step's pool, chosen with this step's weights (before the update)
            with mode if mode is not None else contextlib.nullcontext():
                pending = [pick(next(sampler))]
        if mode is not None:
            peak = max(peak, mode.peak)
        opt.step()
        dt = time.perf_counter() - t0
        if not measure:
            times.append(dt)
        elapsed += dt
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            curve.append((elapsed, task.evaluate(model)["heldout_loss"]))
    row = task.evaluate(model)
    row.update(peak_activation_bytes=peak, step_s=statistics.median(times), curve=curve)
    row.update({k: v / len(times) for k, v in spent.items()})  # per step (first one included)
    return row


def run(rank: int, world: int, args) -> dict:
    """Every method x seed; rows by method, seed order kept (paired)."""
    from megatron_mllm.runtime.assembly.bootstrap import init_rank

    init_rank(rank, world, 0, 60.0)
    task = {"llava": llava_task, "mllm": mllm_task, "gpt": gpt_task}[args.model](args)
    results = {m: [] for m in METHODS}
    for seed in range(args.seeds):
        for method in METHODS:
            results[method].append(train_one(args, task, method, seed))
        print(f"seed {seed + 1}/{args.seeds} done", file=sys.stderr, flush=True)
    return {"describe": task.describe, "results": results}


def pipeline_jobs(args) -> dict:
    """The step-time runs on a 2-stage pipeline (Optimus, distributed optimizer): B
    alone, 2B by accumulation (2N micro-batches, B's memory), the coreset (the pool's pass, then
    the step) and the coreset with look-ahead (the next pool in the step's bubbles)."""
    from bench_common import bench_run

    from megatron_mllm.data.coreset import CoresetConfig
    from megatron_mllm.parallel.plans import ParallelPlan
    from megatron_mllm.runtime.assembly.launch import spawn
    from megatron_mllm.runtime.modes.reference import make_full_state
    from megatron_mllm.runtime.planning.profile_units import profile_units
    from megatron_mllm.runtime.planning.schedules import pool_plan, runtime_plan
    from megatron_mllm.schedule.lookahead import with_lookahead

    cfg, plan, mb = mllm_config(args, text_len=args.pipeline_text), ParallelPlan(1, 1, 2), 2
    n = args.batch // mb
    state = spawn(make_full_state, 1, cfg, 0)[0]
    # Plans and the merge from unit times measured here, both ranks at once (their contention).
    measured = spawn(profile_units, plan.world_size, cfg, mb, 5)[0]
    step, workload = runtime_plan(cfg, plan, mb, n, "optimus", measured=measured)
    pool, _ = pool_plan(step, cfg, plan, mb, 2 * n, measured=measured)
    double, _ = runtime_plan(cfg, plan, mb, 2 * n, "optimus", measured=measured)
    coreset = CoresetConfig(batch_size=args.batch, pool_ratio=2, features="zo", seed=0)
    merged = with_lookahead(step, pool, workload)

    # fp32: bf16 matrix products are ~65x slower on this CPU
    fp32 = argparse.Namespace(precision="fp32")
    run = bench_run(cfg, fp32, plan, n, mb, "--lr", "1e-3", "--use-distributed-optimizer")
    base = run.runtime_job(step, state, units="layer")

    def job(schedule, n_mb, **data):
        plans = replace(base.plans, schedule=schedule)
        return replace(base, plans=plans, data=replace(base.data, num_microbatches=n_mb, **data))

    jobs = {
        "B": job(step, n),
        "2B_accumulation": job(double, 2 * n),
        "coreset": job(step, n, coreset=coreset, pool_schedule=pool),
        "coreset_lookahead": job(
            step, n, coreset=coreset, pool_schedule=pool, lookahead_schedule=merged
        ),
    }
    describe = (
        f"PP=2 on 2 ranks, Optimus, fp32 + distributed optimizer, ViT {cfg.vit_layers}x"
        f"{cfg.vit_hidden} + GPT {cfg.llm_layers}x{cfg.llm_hidden}, sequence {cfg.seq_len}, "
        f"synthetic image-caption pools (10 classes), B={args.batch} in micro-batches of {mb}"
    )
    return {"jobs": jobs, "describe": describe, "predicted": asdict(merged.lookahead_times)}


def pipeline_steps(rank: int, world: int, jobs: dict, steps: int) -> dict:
    """Every run builds once, then they take steps in turn; each step's wall time from a
    barrier before it to a barrier after it (the slower rank's time)."""
    import torch.distributed as dist

    from megatron_mllm.runtime.assembly.bootstrap import init_rank
    from megatron_mllm.runtime.modes.runs import make_run

    device = init_rank(rank, world, 0, 120.0)
    runs = {name: make_run(rank, world, job, device) for name, job in jobs.items()}
    times = {name: [] for name in runs}
    for step in range(steps):
        for name, run in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            run.step(step)
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
    return times


def pipeline_section(args) -> dict:
    """Median step seconds (and spread) per run, measured steps after one warm-up each."""
    from megatron_mllm.runtime.assembly.launch import spawn

    built = pipeline_jobs(args)
    times = spawn(pipeline_steps, 2, built["jobs"], args.pipeline_steps + 1, timeout_s=7200)[0]
    out = {"describe": built["describe"], "predicted": built["predicted"], "runs": {}}
    acc = statistics.median(times["2B_accumulation"][1:])
    for name, ts in times.items():
        ts = ts[1:]
        med = statistics.median(ts)
        out["runs"][name] = {"step_s": med, "min_s": min(ts), "max_s": max(ts),
                             "vs_accumulation": med / acc}  # fmt: skip
    pairs = [
        a / c for a, c in zip(times["coreset_lookahead"][1:], times["coreset"][1:], strict=True)
    ]
    out["lookahead_vs_coreset"] = (statistics.median(pairs), min(pairs), max(pairs))
    return out


def print_pipeline(p: dict) -> None:
    print(f"step time on a pipeline: {p['describe']}; medians over the measured steps (min-max)")
    for name, r in p["runs"].items():
        print(f"  {name:<18}{1000 * r['step_s']:>9.1f} ms ({1000 * r['min_s']:.1f}-"
              f"{1000 * r['max_s']:.1f}){r['vs_accumulation']:>7.2f}x accumulation")  # fmt: skip
    med, lo, hi = p["lookahead_vs_coreset"]
    pred = p["predicted"]
    alone = pred["step_alone_s"] + pred["pool_alone_s"]
    print(f"  look-ahead / same-step coreset, paired by step: {med:.3f} ({lo:.3f}-{hi:.3f}); "
          f"the planner predicted {pred['step_s'] / alone:.3f}")  # fmt: skip


def time_to_target(curve, target: float) -> float | None:
    """Training seconds until the held-out loss first reaches `target` (None: never)."""
    return next((t for t, loss in curve if loss <= target), None)


def paired(rows, base_rows, key: str) -> tuple[float, float]:
    """Mean paired difference (rows - base_rows) on `key` and its 95% half-interval."""
    diffs = [r[key] - b[key] for r, b in zip(rows, base_rows, strict=True)]
    if len(diffs) < 2:
        return diffs[0], float("nan")
    t = T975.get(len(diffs) - 1, 1.96)
    return statistics.mean(diffs), t * statistics.stdev(diffs) / len(diffs) ** 0.5


def summarise(results: dict) -> dict:
    base = results["2B_accumulation"]
    for rows in results.values():
        for row, ref in zip(rows, base, strict=True):
            row["time_to_accumulation_loss_s"] = time_to_target(row["curve"], ref["heldout_loss"])
    out = {}
    for m, rows in results.items():
        stat = {}
        for key in rows[0]:
            if key == "curve":
                continue
            vals = [r[key] for r in rows if r[key] is not None]
            stat[key] = statistics.mean(vals) if vals else None
            if key == "time_to_accumulation_loss_s":
                stat["reached"] = f"{len(vals)}/{len(rows)}"
        for key in ("heldout_loss", "heldout_accuracy", "step_s"):
            stat[f"{key}_vs_accumulation"] = paired(rows, base, key)
        out[m] = stat
    # Look-ahead against same-step selection (zeroth-order both), paired by seed.
    ahead, now = results["coreset_lookahead"], results["coreset_zo"]
    out["lookahead_vs_same_step"] = {
        k: paired(ahead, now, k) for k in ("heldout_loss", "heldout_accuracy")
    }
    return out


def print_table(args, describe: str, s: dict) -> None:
    mem2b = s["2B_batch"]["peak_activation_bytes"]
    acc = s["2B_accumulation"]["step_s"]
    tb, t2b = s["random_B"]["step_s"], s["2B_batch"]["step_s"]
    overhead = max(0.0, 2 * tb - t2b) / tb  # t(n) = a + c n: a / t(B)
    print(
        f"{describe}; size {args.size}; B={args.batch}, pool 2B, {args.steps} steps, "
        f"{args.seeds} seeds paired; +- = 95% interval of the difference to 2B accumulation"
    )
    print(f"fixed (per-step, not per-sample) share of a B step: {overhead:.0%} (from B, 2B)")
    print(f"{'method':<16}{'held-out loss':>22}{'worst src':>10}{'accuracy':>19}{'worst':>7}"
          f"{'mem vs 2B':>10}{'step ms':>9}{'vs accum':>9}{'to accum loss s':>17}")  # fmt: skip
    for m in METHODS:
        r = s[m]
        dl, dli = r["heldout_loss_vs_accumulation"]
        da, dai = r["heldout_accuracy_vs_accumulation"]
        reach = r["time_to_accumulation_loss_s"]
        reach = f"{reach:.1f} ({r['reached']})" if reach is not None else f"never ({r['reached']})"
        print(
            f"{m:<16}{r['heldout_loss']:>8.4f} {dl:+.4f}+-{dli:<6.4f}"
            f"{r['worst_source_loss']:>9.3f}{r['heldout_accuracy']:>7.3f} {da:+.3f}+-{dai:<5.3f}"
            f"{r['worst_source_accuracy']:>6.2f}{r['peak_activation_bytes'] / mem2b:>9.2f}x"
            f"{1000 * r['step_s']:>9.1f}{r['step_s'] / acc:>8.2f}x{reach:>17}"
        )
    (dl, dli), (da, dai) = s["lookahead_vs_same_step"].values()
    print(f"look-ahead - same-step selection (paired): held-out loss {dl:+.4f}+-{dli:.4f}, "
          f"accuracy {da:+.3f}+-{dai:.3f}")  # fmt: skip
    for m in ("coreset_zo", "coreset_exact", "coreset_lookahead"):
        r = s[m]
        parts = ", ".join(
            f"{k[:-2].replace('_', ' ')} {1000 * r[k]:.1f}"
            for k in ("pool_forward_s", "features_s", "facility_location_s")
        )
        print(f"{m} selection per step (ms): {parts}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", choices=["llava", "mllm", "gpt"], default="llava")
    ap.add_argument("--size", choices=["tiny", "wide"], default="tiny")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16, help="B")
    ap.add_argument("--examples", type=int, default=2000)
    ap.add_argument("--held-out", type=int, default=30, help="held-out examples per source")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument(
        "--pipeline-steps",
        type=int,
        default=0,
        help="also time B, 2B accumulation, coreset and look-ahead on a 2-stage pipeline for "
        "this many steps (2 processes; 0: skip)",
    )
    ap.add_argument("--pipeline-text", type=int, default=112, help="text tokens (pipeline)")
    ap.add_argument("--skip-quality", action="store_true", help="only the pipeline timing")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.steps < 2 or args.seeds < 1 or args.batch < 1 or args.eval_every < 1:
        print("error: --steps >= 2, --seeds >= 1, --batch and --eval-every >= 1", file=sys.stderr)
        return 2
    from megatron_mllm.runtime.assembly.launch import spawn

    if args.pipeline_steps < 0 or (args.skip_quality and not args.pipeline_steps):
        print("error: --pipeline-steps must be >= 0 (and > 0 with --skip-quality)", file=sys.stderr)
        return 2
    pipe = pipeline_section(args) if args.pipeline_steps else None
    if args.skip_quality:
        print(json.dumps({"pipeline": pipe}) if args.json else "", end="")
        if not args.json:
            print_pipeline(pipe)
        return 0
    out = spawn(run, 1, args, timeout_s=7200)[0]
    s = summarise(out["results"])
    if args.json:
        z, a = s["coreset_zo"], s["2B_accumulation"]
        print(json.dumps({
            "coreset_step_s": z["step_s"], "accumulation_step_s": a["step_s"],
            "coreset_heldout_loss": z["heldout_loss"],
            "accumulation_heldout_loss": a["heldout_loss"],
            "coreset_memory_vs_2b": z["peak_activation_bytes"]
            / s["2B_batch"]["peak_activation_bytes"],
            "lookahead_heldout_loss": s["coreset_lookahead"]["heldout_loss"],
            "lookahead_vs_same_step": s["lookahead_vs_same_step"],
            "seeds": args.seeds, "model": args.model, "size": args.size, "methods": s,
            "pipeline": pipe,
        }))  # fmt: skip
        return 0
    print_table(args, out["describe"], s)
    if pipe is not None:
        print_pipeline(pipe)
    return 0


if __name__ == "__main__":
    sys.exit(main())
