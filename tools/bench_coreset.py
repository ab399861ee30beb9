#!/usr/bin/env python
"""Benchmark: coreset B-from-2B against random B, stratified random B, 2B in one batch and 2B by
gradient accumulation, on a tiny megatron-core GPT trained on the math + digits-caption mixture
(--model gpt), or on the tiny MLLM (ViT + projector + GPT from megatron-core parts) trained to
caption scikit-learn's handwritten digits, imbalanced by class (source = digit; --model mllm).

Per method: held-out loss overall and on the worst source, peak activation memory (bytes saved
for backward during the largest forward of a step, measured with torch's saved-tensors hooks),
step time with the selection included; mean and spread over seeds. All methods run in one
process, from the same initial weights, on the same pools.

    python tools/bench_coreset.py [--model gpt|mllm] [--steps 150] [--seeds 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|absl|cuda_graph).*")

METHODS = ("random_B", "stratified_B", "2B_batch", "2B_accumulation", "coreset_zo", "coreset_exact")


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


def run(rank: int, world: int, args) -> dict:
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_mllm.data.mixture import VOCAB, build_mixture
    from megatron_mllm.data.sampler import CoresetHook, answer_loss
    from megatron_mllm.models.config import MLLMConfig, transformer_config
    from megatron_mllm.models.stages import causal_mask
    from megatron_mllm.parallel.groups import build_colocated_groups
    from megatron_mllm.parallel.plans import ParallelPlan
    from megatron_mllm.runtime.bootstrap import init_rank, seed_model_parallel

    init_rank(rank, world, 0, 60.0)
    one = ParallelPlan(1, 1, 1)
    groups = build_colocated_groups(one, one, 1, 0)
    seq = 32
    train, held = build_mixture(args.examples, seed=0, seq_len=seq)
    mask = causal_mask(seq)
    pos = torch.arange(seq).unsqueeze(0)

    def new_model(seed):
        torch.manual_seed(seed)
        seed_model_parallel(seed)
        cfg = transformer_config(
            MLLMConfig(llm_layers=2, llm_hidden=64, llm_heads=4, vocab_size=len(VOCAB)), "llm", 1, 1
        )
        return GPTModel(
            cfg,
            get_gpt_layer_local_spec(),
            len(VOCAB),
            seq,
            pg_collection=groups.backbone,
            share_embeddings_and_output_weights=False,
            position_embedding_type="rope",
        )

    def logits(model, tokens):
        return model(tokens, pos.expand(tokens.shape[0], -1), mask)

    def loss_of(model, idx, data):
        return answer_loss(
            logits(model, data.tokens[idx]), data.tokens[idx], data.answer_mask[idx]
        ).mean()

    def loss_of_train(model, idx):
        return loss_of(model, idx, train)

    @torch.no_grad()
    def evaluate(model):
        per = answer_loss(logits(model, held.tokens), held.tokens, held.answer_mask)
        by = [float(per[held.source == s].mean()) for s in range(len(held.names))]
        return {"heldout_loss": float(per.mean()), "worst_source_loss": max(by)}

    def select(hook, model, pool):
        return hook.select(
            lambda t, m=model: logits(m, t),
            train.tokens[pool],
            train.answer_mask[pool],
            train.source[pool],
        )

    def make_hook(model, config):
        return CoresetHook(config, model.output_layer)

    return train_all(
        args, len(train), train.source, new_model, loss_of_train, evaluate, make_hook, select
    )


def run_mllm(rank: int, world: int, args) -> dict:
    """The tiny MLLM captioning digits; source = digit class, imbalanced ~ 1 / (class + 1)."""
    import tempfile

    import torch
    import torch.nn.functional as F

    from megatron_mllm.data.batch import image_then_text
    from megatron_mllm.data.coreset import CoresetSelector
    from megatron_mllm.data.sampler import VocabParallelReplay
    from megatron_mllm.data.webdataset import ImageCaptionShards, write_digit_shards
    from megatron_mllm.models.config import MLLMConfig
    from megatron_mllm.runtime.bootstrap import init_rank, seed_model_parallel
    from megatron_mllm.runtime.model_builder import build_full_model

    init_rank(rank, world, 0, 60.0)
    cfg = MLLMConfig(llm_layers=2, text_len=20)
    with tempfile.TemporaryDirectory() as tmp:
        write_digit_shards(tmp, energon=False)
        data = ImageCaptionShards(tmp)
    words = "zero one two three four five six seven eight nine".split()
    label = torch.tensor([words.index(c.split()[-1]) for c in data.captions])
    g = torch.Generator().manual_seed(0)
    train_idx, held_idx = [], []
    for c in range(10):
        rows = (label == c).nonzero().squeeze(1)
        rows = rows[torch.randperm(len(rows), generator=g)]
        held_idx += rows[:30].tolist()
        rest = rows[30:]
        train_idx += rest[: max(8, len(rest) // (c + 1))].tolist()  # a few big, several small
    images, text = data.batch(
        train_idx + held_idx, cfg.image_size, cfg.channels, cfg.text_len, cfg.vocab_size
    )
    n_train, n, T = len(train_idx), cfg.num_patches, cfg.text_len
    sources = label[train_idx]
    held = torch.arange(n_train, len(train_idx) + len(held_idx))
    held_source = label[held_idx]

    class TinyMLLM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            built = build_full_model(cfg)
            self.encoder, self.backbone = built.encoders[0], built.backbone

        def forward(self, idx):
            bb = self.backbone
            batch = image_then_text(images[idx], text[idx], n)
            return bb(None, bb.decoder_input([self.encoder(batch.images)], batch))

    def new_model(seed):
        torch.manual_seed(seed)
        seed_model_parallel(seed)
        return TinyMLLM()

    def per_example(model, idx):
        pred = model(idx)[:, n - 1 : n - 1 + T]
        flat = pred.reshape(-1, pred.shape[-1])
        ce = F.cross_entropy(flat, text[idx].reshape(-1), reduction="none")
        exact = (pred.argmax(-1) == text[idx]).all(-1).float()
        return ce.view(-1, T).mean(-1), exact

    def loss_of(model, idx):
        return per_example(model, idx)[0].mean()

    @torch.no_grad()
    def evaluate(model):
        loss, exact = per_example(model, held)
        by = [
            (float(loss[held_source == c].mean()), float(exact[held_source == c].mean()))
            for c in range(10)
        ]
        return {
            "heldout_loss": float(loss.mean()),
            "worst_source_loss": max(b[0] for b in by),
            "heldout_accuracy": float(exact.mean()),
            "worst_source_accuracy": min(b[1] for b in by),
        }

    def select(selector, model, pool):
        captured = []
        out = model.backbone.gpt.output_layer
        handle = out.register_forward_pre_hook(
            lambda m, a: captured.append(a[0].transpose(0, 1).detach())
        )
        with torch.no_grad():
            model(pool)
        handle.remove()
        block = out.weight.detach()
        hidden, labels = captured[0], image_then_text(images[pool], text[pool], n).labels
        return selector.select(sources[pool], VocabParallelReplay(), hidden, labels, block)

    def make_selector(model, config):
        return CoresetSelector(config)

    return train_all(args, n_train, sources, new_model, loss_of, evaluate, make_selector, select)


def train_all(args, n_train, sources, new_model, loss_of, evaluate, make_hook, select) -> dict:
    """Every method x seed from the same initial weights on the same pools: held-out metrics,
    peak activation bytes (saved for backward in the largest forward), median step time."""
    import torch

    from megatron_mllm.data.coreset import CoresetConfig, source_budgets
    from megatron_mllm.data.sampler import PoolSampler

    b = args.batch
    results = {m: [] for m in METHODS}
    for seed in range(args.seeds):
        for method in METHODS:
            model = new_model(1000 + seed)
            opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
            sampler = iter(PoolSampler(n_train, 2 * b, seed=seed))
            hook = None
            if method.startswith("coreset"):
                config = CoresetConfig(batch_size=b, features=method.split("_")[1], seed=seed)
                hook = make_hook(model, config)
            gen = torch.Generator().manual_seed(seed)
            peak, times = 0, []
            for _ in range(args.steps):
                pool = next(sampler)
                t0 = time.perf_counter()
                if method == "random_B":
                    batches = [pool[:b]]
                elif method == "stratified_B":
                    budgets = source_budgets(sources[pool], b)
                    pick = []
                    for s, k in budgets.items():
                        rows = (sources[pool] == s).nonzero().squeeze(1)
                        pick.append(rows[torch.randperm(len(rows), generator=gen)[:k]])
                    batches = [pool[torch.cat(pick)]]
                elif method == "2B_batch":
                    batches = [pool]
                elif method == "2B_accumulation":
                    batches = [pool[:b], pool[b:]]
                else:
                    batches = [pool[select(hook, model, pool)]]
                opt.zero_grad()
                for idx in batches:
                    with SavedBytes() as saved:
                        loss = loss_of(model, idx) / len(batches)
                    peak = max(peak, saved.total)
                    loss.backward()
                opt.step()
                times.append(time.perf_counter() - t0)
            row = evaluate(model)
            row.update(peak_activation_bytes=peak, step_s=statistics.median(times))
            results[method].append(row)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", choices=["gpt", "mllm"], default="gpt")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16, help="B")
    ap.add_argument("--examples", type=int, default=4000)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from megatron_mllm.runtime.launch import spawn

    results = spawn(run_mllm if args.model == "mllm" else run, 1, args, timeout_s=3600)[0]
    summary = {}
    for m, rows in results.items():

        def stat(key, rows=rows):
            vals = [r[key] for r in rows]
            return statistics.mean(vals), (max(vals) - min(vals)) / 2 if len(vals) > 1 else 0.0

        summary[m] = {k: stat(k) for k in rows[0]}
    if args.json:
        print(json.dumps(summary))
        return 0
    base_mem = summary["2B_batch"]["peak_activation_bytes"][0]
    base_step = summary["random_B"]["step_s"][0]
    print(f"B={args.batch}, pool 2B, {args.steps} steps, {args.seeds} seeds (mean +- half-range)")
    accuracy = "heldout_accuracy" in summary["random_B"]
    print(
        f"{'method':<17}{'held-out loss':>17}{'worst source':>17}{'act. mem vs 2B':>16}"
        f"{'step ms':>9}{'vs random B':>13}"
        + (f"{'accuracy':>15}{'worst source':>15}" if accuracy else "")
    )
    for m in METHODS:
        s = summary[m]
        (lo, ls), (wo, ws) = s["heldout_loss"], s["worst_source_loss"]
        mem, step = s["peak_activation_bytes"][0], s["step_s"][0]
        line = (
            f"{m:<17}{lo:>10.4f}+-{ls:<5.3f}{wo:>10.4f}+-{ws:<5.3f}{mem / base_mem:>15.2f}x"
            f"{1000 * step:>9.1f}{step / base_step:>12.2f}x"
        )
        if accuracy:
            (ao, aspread), (aw, awspread) = s["heldout_accuracy"], s["worst_source_accuracy"]
            line += f"{ao:>9.3f}+-{aspread:<4.2f}{aw:>9.3f}+-{awspread:<4.2f}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
