"""The coreset sampler hook for a Megatron-style data pipeline.

`PoolSampler` is a batch sampler that yields pools of r x B example indices (consumed samples
count the whole pool). `CoresetHook.select` runs the model without gradients over a pool,
captures the input of the last layer (the output projection), computes the selector's features
by replaying only that layer, and returns the B pool positions to train on.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from megatron_mllm.data.coreset import CoresetConfig, CoresetSelector
from megatron_mllm.errors import ConfigError


class PoolSampler:
    """Deterministic pools of `pool_size` indices over `total` examples, epoch after epoch.

    With data parallelism each DP rank gets every `dp_size`-th example of the global pool and
    selects from its own share (B / DP of them): no features or indices cross the DP group, the
    pool forward stays local, and per-source budgets are taken on each share. The alternative,
    gathering the whole pool's features, selects slightly better for rare sources but costs an
    all-gather of features per step; we chose the local share (Megatron's data-parallel samplers
    split a global batch the same way)."""

    def __init__(
        self,
        total: int,
        pool_size: int,
        seed: int = 0,
        consumed_samples: int = 0,
        dp_rank: int = 0,
        dp_size: int = 1,
    ):
        if pool_size > total:
            raise ConfigError(f"pool of {pool_size} examples but the data set has {total}")
        if pool_size % dp_size:
            raise ConfigError(f"pool of {pool_size} does not split over {dp_size} DP ranks")
        self.total, self.pool_size, self.seed = total, pool_size, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.consumed_samples = consumed_samples  # counts the whole (global) pool

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            per_epoch = self.total // self.pool_size
            epoch, k = divmod(self.consumed_samples // self.pool_size, per_epoch)
            perm = torch.randperm(
                self.total, generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            )
            self.consumed_samples += self.pool_size
            pool = perm[k * self.pool_size : (k + 1) * self.pool_size]
            yield pool[self.dp_rank :: self.dp_size]

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.consumed_samples, self.seed = state["consumed_samples"], state["seed"]


def answer_loss(logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-example mean next-token loss over answer positions; logits [b, s, V]."""
    targets = tokens[:, 1:]
    ce = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
    )
    ce = ce.view(targets.shape) * mask[:, :-1]
    return ce.sum(1) / mask[:, :-1].sum(1).clamp(min=1)


class CoresetHook:
    """Selection step: gradient-free pool forward, last-layer features, B indices out."""

    def __init__(self, config: CoresetConfig, output_layer: torch.nn.Module) -> None:
        if not hasattr(output_layer, "weight"):
            raise ConfigError("the coreset feature block must be a layer with a weight")
        self.selector = CoresetSelector(config)
        self.output_layer = output_layer

    @torch.no_grad()
    def last_layer_inputs(self, forward, tokens: torch.Tensor) -> torch.Tensor:
        """Run `forward(tokens)` without gradients; return the output layer's input [b, s, h]."""
        captured = {}

        def hook(module, args, kwargs):
            captured["h"] = args[0] if args else kwargs["input_"]

        handle = self.output_layer.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            forward(tokens)
        finally:
            handle.remove()
        return captured["h"].transpose(0, 1).detach()  # megatron-core is [s, b, h]

    def select(
        self, forward, tokens: torch.Tensor, mask: torch.Tensor, source: torch.Tensor
    ) -> torch.Tensor:
        hidden = self.last_layer_inputs(forward, tokens)
        targets = torch.stack([tokens, mask.long()], dim=-1)

        def loss(h, t, block):
            return answer_loss(h @ block.T, t[..., 0], t[..., 1].bool())

        return self.selector.select(source, loss, hidden, targets, self.output_layer.weight)

    def state_dict(self) -> dict:
        return self.selector.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.selector.load_state_dict(state)


def broadcast_selection(
    indices: torch.Tensor | None,
    batch_size: int,
    group,
    src: int,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Pipeline parallelism: the last stage (global rank `src`) selects, every stage of the
    pipeline (`group`) gets the same B indices, on `device` (the group's: CUDA under NCCL)."""
    import torch.distributed as dist

    if indices is not None:
        buf = indices.to(device, dtype=torch.long, copy=True)
    else:
        buf = torch.empty(batch_size, dtype=torch.long, device=device)
    dist.broadcast(buf, src=src, group=group)
    return buf


def labelled_positions(hidden: torch.Tensor, labels: torch.Tensor):
    """Only the positions that carry a label, each example's in order and padded (with
    `IGNORE_INDEX`) to the most any example has: hidden [n, m, h], labels [n, m]. The replay
    then costs m positions, not the whole sequence (a LLaVA answer is a few tokens of it)."""
    from megatron_mllm.data.batch import IGNORE_INDEX

    keep = labels != IGNORE_INDEX
    m = max(1, int(keep.sum(1).max()))
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :m]
    picked = hidden.gather(1, order[..., None].expand(-1, -1, hidden.shape[-1]))
    return picked, labels.gather(1, order)


class VocabParallelReplay:
    """The MLLM's last-layer replay for selection features (`coreset.LossReplay`'s interface):
    each example's mean next-token loss over its labelled positions, from the output layer's
    inputs `hidden` [n, s, h] (the same on every TP rank) and labels [n, s] (`IGNORE_INDEX`
    where none). The output layer may be vocabulary-parallel, as megatron-core's is: this
    rank's block holds vocabulary rows [vocab_start, vocab_start + block rows) of `vocab_size`,
    and the softmax's max, sum of exponentials and target logit are reduced over `group` (None:
    TP 1, the whole vocabulary here). Every TP rank gets the same losses and features."""

    def __init__(self, group=None, vocab_start: int = 0, vocab_size: int | None = None) -> None:
        self.group, self.vocab_start, self.vocab_size = group, vocab_start, vocab_size

    def _reduce(self, t: torch.Tensor, op) -> torch.Tensor:
        import torch.distributed as dist

        if self.group is not None:
            dist.all_reduce(t, op=op, group=self.group)
        return t

    def _softmax_parts(self, hidden, labels, blocks):
        """Per block: logits [K, n, s, v] and the reduced max, sum of exponentials, target
        logit [K, n, s]; the labelled positions [n, s]; the target's local column [n, s]."""
        import torch.distributed as dist

        from megatron_mllm.data.batch import IGNORE_INDEX

        logits = torch.einsum("nsh,kvh->knsv", hidden, blocks)
        top = self._reduce(logits.amax(-1), dist.ReduceOp.MAX)
        sum_exp = self._reduce((logits - top[..., None]).exp().sum(-1), dist.ReduceOp.SUM)
        keep = labels != IGNORE_INDEX
        local = labels - self.vocab_start
        here = keep & (local >= 0) & (local < blocks.shape[1])
        local = local.clamp(0, blocks.shape[1] - 1)
        index = local.expand(blocks.shape[0], *local.shape)[..., None]
        target = logits.gather(-1, index).squeeze(-1) * here
        target = self._reduce(target, dist.ReduceOp.SUM)
        return logits, top, sum_exp, target, keep, local, here

    def losses(self, hidden, labels, blocks: torch.Tensor) -> torch.Tensor:
        """[K, n]: every example's loss under each of the K blocks [K, v, h]."""
        hidden, labels = labelled_positions(hidden, labels)
        _, top, sum_exp, target, keep, _, _ = self._softmax_parts(hidden, labels, blocks)
        ce = sum_exp.log() + top - target
        return (ce * keep).sum(-1) / keep.sum(-1).clamp(min=1)

    def _logit_grads(self, hidden, labels, block: torch.Tensor):
        """The labelled positions' inputs [n, m, h] and the loss's gradient with respect to
        this shard's logits [n, m, v] (softmax minus one-hot, over each example's count)."""
        hidden, labels = labelled_positions(hidden, labels)
        logits, top, sum_exp, _, keep, local, here = self._softmax_parts(
            hidden, labels, block[None]
        )
        p = (logits[0] - top[0][..., None]).exp() / sum_exp[0][..., None]
        p = p - torch.nn.functional.one_hot(local, block.shape[0]).to(p.dtype) * here[..., None]
        weight = keep / keep.sum(-1, keepdim=True).clamp(min=1)
        return hidden, p * weight[..., None]

    @torch.no_grad()
    def gradients(self, hidden, labels, block: torch.Tensor) -> torch.Tensor:
        """[n, vocab_size * h]: per-example gradients of the loss with respect to the whole
        output weight, in closed form (softmax minus one-hot, times the inputs), gathered over
        the vocabulary shards in rank order."""
        import torch.distributed as dist

        hidden, dlogits = self._logit_grads(hidden, labels, block)
        g = torch.einsum("nsv,nsh->nvh", dlogits, hidden)  # [n, v, h]
        if self.group is not None:
            shards = [torch.empty_like(g) for _ in range(dist.get_world_size(self.group))]
            dist.all_gather(shards, g.contiguous(), group=self.group)
            g = torch.cat(shards, dim=1)
        return g.reshape(g.shape[0], -1)

    @torch.no_grad()
    def projected_gradients(self, hidden, labels, block: torch.Tensor, directions) -> torch.Tensor:
        """[n, k]: each example's loss gradient with respect to the whole output weight,
        projected on k directions (`directions`: chunks [c, v, h] of this shard's rows, drawn
        as they are read): the directional derivatives that two-sided perturbation of the same
        directions approximates, in closed form. The examples' gradients are held at once
        where they fit in what perturbing a chunk would hold (2c blocks and 2c x the logits),
        else made again for each chunk in groups that fit."""
        import torch.distributed as dist

        hidden, dlogits = self._logit_grads(hidden, labels, block)
        n, size = hidden.shape[0], block.numel()

        def grads(i: int, j: int) -> torch.Tensor:  # examples i to j (at most n)
            g = torch.einsum("nsv,nsh->nvh", dlogits[i:j], hidden[i:j])
            return g.reshape(g.shape[0], size)

        held, cols = None, []
        for z in directions:
            flat = z.to(block.device).reshape(z.shape[0], size).T
            per = max(1, 2 * z.shape[0] * (size + dlogits.numel()) // size)
            if per >= n:
                held = grads(0, n) if held is None else held
                cols.append(held @ flat)
            else:
                cols.append(torch.cat([grads(i, i + per) @ flat for i in range(0, n, per)]))
        feats = torch.cat(cols, dim=1)
        if self.group is not None:  # each shard holds its rows' share of every product
            dist.all_reduce(feats, group=self.group)
        return feats

    def directions(self, k: int, block: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """[k, v, h]: this shard's rows of k standard normal directions over the whole
        vocabulary, drawn alike on every TP rank (the same as TP 1 draws)."""
        rows = self.vocab_size or block.shape[0]
        shape = (k, rows, block.shape[1])
        z = torch.randn(shape, generator=generator, dtype=block.dtype, device="cpu")
        return z[:, self.vocab_start : self.vocab_start + block.shape[0]]
