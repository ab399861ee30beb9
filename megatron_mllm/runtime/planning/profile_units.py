"""Measure the runtime model's unit times (forward and backward of the patch embedding, one
encoder layer, the projector, one backbone layer, the LM head) for the planner.

Returns the measured-times mapping that `JobCosts(..., unit="layer")` reads:
{"vit": {"forward": {"embed": s, "layer": s, "projector": s}, "backward": {"embed_b": ...}},
 "llm": {"forward": {"layer": s, "head": s}, "backward": {"layer_b": s, "head_b": s}},
 "dp": {"gbps": {"reduce_scatter": GB/s, "all_gather": GB/s}}} (the last with several ranks).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_mllm.models.config import MLLMConfig
from megatron_mllm.models.stages import causal_mask
from megatron_mllm.runtime.engine.clock import cache_flusher, median_seconds


def _fwd_bwd(
    unit, make_input, repeats: int, device: torch.device, flush: Callable[[], object] | None
) -> tuple[float, float]:
    def forward():
        return unit(make_input())

    def both():
        y = unit(make_input())
        y.backward(torch.ones_like(y))

    fwd = median_seconds(forward, repeats, device, before=flush)
    return fwd, max(median_seconds(both, repeats, device, before=flush) - fwd, 0.0)


def profile_units(
    rank: int,
    world: int,
    cfg: MLLMConfig,
    micro_batch: int,
    repeats: int = 5,
    dtype: torch.dtype = torch.float32,
    bucket_params: int | None = None,
    cold: bool = True,
) -> dict:
    """Run in fresh processes (see `launch.spawn`). With several ranks they all profile at once,
    so the times include the contention a real multi-rank step sees on a shared machine, and
    a DDP bucket's DP collectives are timed over them (`link_probe.dp_collective_gbps`,
    `bucket_params`: the job's bucket size). `dtype`: the parameters' and activations' (bf16
    runs profile in bf16). `cold`: each unit timed after a cache flush, as a step runs it
    (False: cache-hot repeats, the ablation of tools/bench_unit_profile.py)."""
    from megatron_mllm.data.batch import image_then_text
    from megatron_mllm.data.synthetic import microbatch
    from megatron_mllm.parallel.groups import build_colocated_groups
    from megatron_mllm.parallel.plans import ParallelPlan
    from megatron_mllm.runtime.assembly.bootstrap import init_rank
    from megatron_mllm.runtime.assembly.model_builder import (
        BackbonePlacement,
        EncoderPlacement,
        build_rank_model,
    )
    from megatron_mllm.runtime.planning.link_probe import dp_collective_gbps

    device = init_rank(rank, world, 0, 60.0)
    plan = ParallelPlan(world, 1, 1)
    groups = build_colocated_groups(plan, plan, world, rank)
    model = build_rank_model(
        cfg,
        BackbonePlacement(groups.backbone),
        EncoderPlacement(groups.encoder),
        device,
        dtype=dtype,
    )
    enc, bb = model.encoders[0], model.backbone
    mask = causal_mask(cfg.seq_len).to(device)
    b = micro_batch
    if cfg.vit_native:  # one nominal image a sample, its patches one sequence
        batch, vit_h = _nominal_native(cfg, b, device, dtype)
        enc.prepare(batch.grids)
    else:
        batch = image_then_text(*microbatch(cfg, 0, micro_batch)[:2], cfg.image_tokens)
        vit_h = torch.randn(cfg.encoder_seq_len, b, cfg.vit_hidden, device=device, dtype=dtype)
    batch = batch.to(device, dtype)
    images = batch.images
    llm_h = torch.randn(cfg.seq_len, b, cfg.llm_hidden, device=device, dtype=dtype)

    def leaf(t):
        return lambda: t.detach().requires_grad_()

    out = {"vit": {"forward": {}, "backward": {}}, "llm": {"forward": {}, "backward": {}}}
    units = {
        ("vit", "embed"): (lambda x: enc.run_unit(0, (x,))[0], lambda: images),
        ("vit", "layer"): (lambda x: enc.run_unit(1, (x,))[0], leaf(vit_h)),
        ("vit", "projector"): (lambda x: enc.run_unit(enc.num_units - 1, (x,))[0], leaf(vit_h)),
        ("llm", "layer"): (
            lambda x: bb.gpt.decoder.layers[0](hidden_states=x, attention_mask=mask)[0],
            leaf(llm_h),
        ),
        ("llm", "head"): (
            lambda x: bb.loss(
                bb.gpt.output_layer(bb.gpt.decoder.final_layernorm(x))[0].transpose(0, 1), batch
            ).reshape(1),
            leaf(llm_h),
        ),
    }
    flush = cache_flusher(device) if cold else None  # each unit timed cold, as a step runs it
    for (model, name), (fn, make) in units.items():
        fwd, bwd = _fwd_bwd(fn, make, repeats, device, flush)
        out[model]["forward"][name] = fwd
        out[model]["backward"][name + "_b"] = bwd
    if cfg.vit_native:
        out["vit"]["tower"] = profile_tower(
            enc, cfg, micro_batch, min(repeats, 3), device, dtype, flush
        )
    rates = dp_collective_gbps(device, bucket_params, dtype)
    if rates:
        out["dp"] = {"gbps": rates}
    return out


def tower_sides(cfg: MLLMConfig, micro_batch: int) -> list[int]:
    """Square patch grids' sides a native tower is profiled at: half the nominal image's,
    each next 1.5x the last (rounded up to a multiple of the merge), to the most patches a
    micro-batch's rows can hold (each merged token one sequence position). Between sizes 2x
    apart the interpolated cost missed by up to 20%, 1.5x apart by up to 10%
    (tools/bench_patch_loads.py)."""
    m, side = cfg.vit_merge, cfg.image_size // cfg.patch_size
    most = int((micro_batch * cfg.seq_len) ** 0.5) * m
    sides = [max(m, side // 2 // m * m)]
    while sides[-1] * 1.5 < most:
        sides.append(-(-int(sides[-1] * 1.5) // m) * m)
    return sorted({*sides, side, most})


def profile_tower(
    enc,
    cfg: MLLMConfig,
    micro_batch: int,
    repeats: int,
    device,
    dtype,
    flush: Callable[[], object] | None = None,
) -> list[list[float]]:
    """[patches, seconds] of the whole native tower's forward + backward on one image of each
    of `tower_sides` (a masked sequence of that many patches, each timed after `flush`):
    `patch_loads.profiled` reads them."""
    out = []
    for side in tower_sides(cfg, micro_batch):
        grids = torch.tensor([[1, side, side]])
        patches = torch.randn(side * side, cfg.patch_dim, device=device, dtype=dtype)

        def both(patches=patches, grids=grids):
            enc(patches, grids).float().sum().backward()

        out.append([side * side, median_seconds(both, repeats, device, before=flush)])
    return out


def _nominal_native(cfg: MLLMConfig, b: int, device, dtype):
    """A native tower's nominal micro-batch: `b` samples of one `image_size` image each (its
    merged tokens first, then text), and a hidden state of its patches."""
    from megatron_mllm.data.batch import IGNORE_INDEX, MicroBatch

    side = cfg.image_size // cfg.patch_size
    grids = torch.tensor([[1, side, side]] * b)
    tokens = torch.randint(1, cfg.vocab_size, (b, cfg.seq_len))
    mask = torch.zeros(b, cfg.seq_len, dtype=torch.bool)
    mask[:, : side * side // cfg.vit_merge**2] = True
    labels = torch.where(mask, IGNORE_INDEX, tokens)
    patches = torch.randn(b * side * side, cfg.patch_dim)
    batch = MicroBatch(patches, tokens, labels, mask, grids=grids, merge=cfg.vit_merge)
    hidden = torch.randn(b * side * side, 1, cfg.vit_hidden, device=device, dtype=dtype)
    return batch, hidden
