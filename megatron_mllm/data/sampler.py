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


def label_replay_loss():
    """The MLLM's last-layer replay for selection features: each example's mean next-token loss
    over its labelled positions, from output-layer inputs `h` [n, s, hidden], labels [n, s]
    (`IGNORE_INDEX` where none) and a candidate output-layer weight `block` [vocab, hidden]
    (the backbone's last stage, TP 1). Synthetic and LLaVA micro-batches alike."""
    from megatron_mllm.data.batch import IGNORE_INDEX

    def loss(h: torch.Tensor, labels: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
        logits = h @ block.T
        keep = labels != IGNORE_INDEX
        ce = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.clamp(min=0).reshape(-1), reduction="none"
        )
        return (ce.view(labels.shape) * keep).sum(-1) / keep.sum(-1).clamp(min=1)

    return loss
