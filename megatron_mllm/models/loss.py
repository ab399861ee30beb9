"""Cross entropy over vocabulary-parallel logits with an explicit TP group (no globals)."""

from __future__ import annotations

import torch
import torch.distributed as dist


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group) -> torch.Tensor:
        world = dist.get_world_size(group)
        rank = dist.get_rank(group)
        part = logits.shape[-1]
        start = rank * part
        logits_max = logits.max(dim=-1)[0]
        if world > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)
        mask = (target < start) | (target >= start + part)
        local = (target - start).masked_fill(mask, 0)
        predicted = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(mask, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        if world > 1:
            dist.all_reduce(predicted, group=group)
            dist.all_reduce(sum_exp, group=group)
        loss = sum_exp.log() - predicted
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local, mask)
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, local, mask = ctx.saved_tensors
        g = softmax.clone()
        onehot = torch.zeros_like(g).scatter_(-1, local.unsqueeze(-1), 1.0)
        g -= onehot * (~mask).unsqueeze(-1).to(g.dtype)
        return g * grad.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group) -> torch.Tensor:
    """Per-token loss; `logits[..., v]` holds this TP rank's slice of the vocabulary."""
    return _VocabParallelCrossEntropy.apply(logits, target, group)


def mean_over_ranks(pairs: list[tuple[float, float]], device: torch.device) -> float:
    """sum(totals) / sum(counts) over every rank's (total, count) pairs: a step's mean loss
    (per micro-batch: (loss, 1); per token: (sum, tokens)). Collective over the default
    group; the same value on every rank; 0 where nothing was counted."""
    total = torch.tensor(
        [sum(p[0] for p in pairs), sum(p[1] for p in pairs)], dtype=torch.float64, device=device
    )
    dist.all_reduce(total)
    return float(total[0] / total[1].clamp(min=1.0))
