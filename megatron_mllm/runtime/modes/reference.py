"""The one-process, non-pipelined reference: the canonical weights every layout starts from (a
model built from a seed), and the reference training run every parallel layout must match. It
runs on the job's device (the rank's GPU where there is one), like every other mode."""

from __future__ import annotations

import torch

from megatron_mllm.models.config import MLLMConfig
from megatron_mllm.models.stages import encode


def make_full_state(rank: int, world: int, cfg: MLLMConfig, seed: int) -> dict[str, torch.Tensor]:
    """Run in a fresh single-rank process (see `launch.spawn`); returns the canonical initial
    weights of `seed` (`seeded_state`, every tensor drawn) as CPU tensors."""
    from megatron_mllm.runtime.assembly.bootstrap import init_rank
    from megatron_mllm.runtime.assembly.model_builder import seeded_state

    init_rank(rank, world, seed, 60.0)
    return dict(seeded_state(cfg, seed))


class ReferenceRun:
    """Every micro-batch of every DP replica in turn, in one process (no parallelism)."""

    def __init__(self, job, device: torch.device) -> None:
        from megatron_mllm.models.weights import open_full_state
        from megatron_mllm.runtime.assembly.model_builder import build_full_model
        from megatron_mllm.runtime.assembly.optimizer import build_optimizer

        self.job, self.device = job, device
        state = open_full_state(job.model.weights)
        self.model = build_full_model(job.cfg, device, state, job.model.frozen_encoder)
        self.optimizer = (
            build_optimizer(self.model.modules, job.optimizer.lr) if job.optimizer.lr > 0 else None
        )
        self.history: list[dict] = []
        self.mean_losses: list[float] = []  # each step's, over every token or micro-batch
        self.grads: dict = {}
        from megatron_mllm.runtime.inputs.batches import StepData

        self.data = StepData(job, list(range(job.backbone.dp)))

    def step(self, step: int) -> None:
        from megatron_mllm.models.weights import grad_shards
        from megatron_mllm.runtime.assembly.optimizer import clip_by_global_norm

        job, model = self.job, self.model
        model.zero_grad()
        data, losses = self.data.step(step), {}
        keys = [(dp, m) for dp in range(job.backbone.dp) for m in range(job.num_microbatches)]
        # Each micro-batch's weight: 1 (a mean loss each), or with a per-token loss (a sum
        # each) its labelled tokens; every loss is divided by the weights' total.
        weight = {k: 1 for k in keys}
        if job.data.per_token_loss:
            weight = {k: data(k[1], k[0]).labelled_tokens for k in keys}
        divisor = max(sum(weight.values()), 1)
        for dp, m in keys:
            batch = data(m, dp).to(self.device, torch.float32)
            embeds = [encode(encoder, batch) for encoder in model.encoders]
            out = model.backbone(None, model.backbone.decoder_input(embeds, batch), batch)
            loss = model.backbone.loss(out, batch, summed=job.data.per_token_loss)
            (loss / divisor).backward()
            losses[(dp, m)] = loss.detach() / max(weight[(dp, m)], 1)  # a mean either way
        self.history.append({k: float(v) for k, v in losses.items()})  # one read per step
        self.mean_losses.append(sum(v * weight[k] for k, v in self.history[-1].items()) / divisor)
        if step == 0:
            self.grads = {k: v for m in model.modules for k, v in grad_shards(m, 0).items()}
        if self.optimizer is not None:
            parts = [(m, None, None) for m in model.modules]
            clip_by_global_norm(parts, job.optimizer.clip_grad, self.device)
            self.optimizer.step()

    def replan(self) -> bool:
        return False

    def result(self) -> dict:
        return {
            "losses": self.history[0],
            "history": self.history,
            "mean_losses": self.mean_losses,
            "grads": self.grads,
        }
