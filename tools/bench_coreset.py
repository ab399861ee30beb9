#!/usr/bin/env python
"""Benchmark: coreset B-from-2B against random B, stratified random B, 2B in one batch and 2B by
gradient accumulation, on a tiny megatron-core GPT trained on the math + digits-caption mixture.

Per method: held-out loss overall and on the worst source, peak activation memory (bytes saved
for backward during the largest forward of a step, measured with torch's saved-tensors hooks),
step time with the selection included; mean and spread over seeds. All methods run in one
process, from the same initial weights, on the same pools.

    python tools/bench_coreset.py [--steps 150] [--seeds 3] [--json]
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

    from megatron_mllm.data.coreset import CoresetConfig, source_budgets
    from megatron_mllm.data.mixture import VOCAB, build_mixture
    from megatron_mllm.data.sampler import CoresetHook, PoolSampler, answer_loss
    from megatron_mllm.models.config import MLLMConfig, transformer_config
    from megatron_mllm.models.stages import causal_mask
    from megatron_mllm.parallel.groups import build_colocated_groups
    from megatron_mllm.parallel.plans import ParallelPlan
    from megatron_mllm.runtime.session import _init_rank

    _init_rank(rank, world, 0, 60.0)
    one = ParallelPlan(1, 1, 1)
    groups = build_colocated_groups(one, one, 1, 0)
    seq, b = 32, args.batch
    train, held = build_mixture(args.examples, seed=0, seq_len=seq)
    mask = causal_mask(seq)
    pos = torch.arange(seq).unsqueeze(0)

    def new_model(seed):
        torch.manual_seed(seed)
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed, tp_rank=0)
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

    @torch.no_grad()
    def evaluate(model):
        per = answer_loss(logits(model, held.tokens), held.tokens, held.answer_mask)
        by = [float(per[held.source == s].mean()) for s in range(len(held.names))]
        return float(per.mean()), max(by)

    results = {m: [] for m in METHODS}
    for seed in range(args.seeds):
        for method in METHODS:
            model = new_model(1000 + seed)
            opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
            sampler = iter(PoolSampler(len(train), 2 * b, seed=seed))
            hook = None
            if method.startswith("coreset"):
                hook = CoresetHook(
                    CoresetConfig(batch_size=b, features=method.split("_")[1], seed=seed),
                    model.output_layer,
                )
            gen = torch.Generator().manual_seed(seed)
            peak, times = 0, []
            for _ in range(args.steps):
                pool = next(sampler)
                t0 = time.perf_counter()
                if method == "random_B":
                    batches = [pool[:b]]
                elif method == "stratified_B":
                    budgets = source_budgets(train.source[pool], b)
                    pick = []
                    for s, k in budgets.items():
                        rows = (train.source[pool] == s).nonzero().squeeze(1)
                        pick.append(rows[torch.randperm(len(rows), generator=gen)[:k]])
                    batches = [pool[torch.cat(pick)]]
                elif method == "2B_batch":
                    batches = [pool]
                elif method == "2B_accumulation":
                    batches = [pool[:b], pool[b:]]
                else:
                    chosen = hook.select(
                        lambda t, m=model: logits(m, t),
                        train.tokens[pool],
                        train.answer_mask[pool],
                        train.source[pool],
                    )
                    batches = [pool[chosen]]
                opt.zero_grad()
                for idx in batches:
                    with SavedBytes() as saved:
                        loss = loss_of(model, idx, train) / len(batches)
                    peak = max(peak, saved.total)
                    loss.backward()
                opt.step()
                times.append(time.perf_counter() - t0)
            overall, worst = evaluate(model)
            results[method].append(
                {
                    "heldout_loss": overall,
                    "worst_source_loss": worst,
                    "peak_activation_bytes": peak,
                    "step_s": statistics.median(times),
                }
            )
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16, help="B")
    ap.add_argument("--examples", type=int, default=4000)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from megatron_mllm.runtime.launch import spawn

    results = spawn(run, 1, args, timeout_s=3600)[0]
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
    print(
        f"{'method':<17}{'held-out loss':>17}{'worst source':>17}{'act. mem vs 2B':>16}"
        f"{'step ms':>9}{'vs random B':>13}"
    )
    for m in METHODS:
        s = summary[m]
        (lo, ls), (wo, ws) = s["heldout_loss"], s["worst_source_loss"]
        mem, step = s["peak_activation_bytes"][0], s["step_s"][0]
        print(
            f"{m:<17}{lo:>10.4f}+-{ls:<5.3f}{wo:>10.4f}+-{ws:<5.3f}{mem / base_mem:>15.2f}x"
            f"{1000 * step:>9.1f}{step / base_step:>12.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
