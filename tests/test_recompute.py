"""Activation recomputation against the memory and cost models: the bytes a layer keeps for
backward, measured with saved-tensor hooks on megatron-core's own layers (bf16), and what the
planner charges for it. Losses and gradients with recomputation: test_runtime."""

from dataclasses import replace

import pytest
import torch

from megatron_mllm.models.config import TINY
from megatron_mllm.models.stages import causal_mask
from megatron_mllm.parallel.plans import ParallelPlan
from megatron_mllm.runtime.assembly.launch import spawn
from megatron_mllm.runtime.planning.schedules import job_of
from megatron_mllm.schedule.blocks import JobCosts
from megatron_mllm.schedule.config import Recompute

B = 2  # micro-batch


def _saved_bytes(rank: int, world: int, cfg, recompute: Recompute) -> dict[str, int]:
    """Bytes of the distinct storages autograd keeps for backward in one forward of the
    backbone's layers and of the encoder, bf16."""
    from megatron_mllm.runtime.assembly.bootstrap import init_rank
    from megatron_mllm.runtime.assembly.model_builder import (
        BackbonePlacement,
        EncoderPlacement,
        build_rank_model,
        solo_groups,
    )

    init_rank(rank, world, 1234, 60)
    pg = solo_groups()
    model = build_rank_model(
        cfg,
        BackbonePlacement(pg),
        EncoderPlacement(pg),
        dtype=torch.bfloat16,
        recompute=recompute,
    )
    bb, enc = model.backbone, model.encoders[0]
    out = {}

    def encoder_layers(x):
        for u in range(1, 1 + cfg.vit_layers):  # unit 0 is the patch embedding
            x = enc.run_unit(u, (x,))[0]
        return x

    def backbone_layers(x):
        return bb.gpt.decoder(hidden_states=x, attention_mask=causal_mask(cfg.seq_len))

    for name, run in (("backbone", backbone_layers), ("encoder", encoder_layers)):
        hidden = cfg.llm_hidden if name == "backbone" else cfg.vit_hidden
        seq = cfg.seq_len if name == "backbone" else cfg.encoder_seq_len
        x = torch.randn(seq, B, hidden, dtype=torch.bfloat16, requires_grad=True)
        storages: dict[int, int] = {}

        def pack(t, storages=storages):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = run(x)
        y.float().sum().backward()
        out[name] = sum(storages.values())
    return out


def per_layer(recompute: Recompute) -> dict[str, float]:
    """Measured bytes per layer: the difference between 4 and 2 layers, halved (what the
    blocks keep outside their layers cancels)."""
    big, small = (
        spawn(_saved_bytes, 1, replace(TINY, llm_layers=n, vit_layers=n), recompute)[0]
        for n in (4, 2)
    )
    return {k: (big[k] - small[k]) / 2 for k in big}


@pytest.fixture(scope="module")
def plain():
    return per_layer(Recompute())


def test_full_recomputation_keeps_exactly_the_layer_input(plain):
    """Full (uniform, 1 layer) and --recompute-vision: each layer keeps its bf16 input and
    nothing else, as the memory model says (CostModel.layer_input_bytes); the measured drop is
    at least the model's (the model counts flash-attention layers, Korthikanti et al.'s 34 sbh;
    megatron-core's local layers keep about twice that: plain > model)."""
    full = per_layer(Recompute("full", "uniform", 1, vision=True))
    job = job_of(TINY, ParallelPlan(1, 1, 1), B, 1)
    cm = JobCosts(job).cm
    llm, vit = job.backbone, job.encoders[0]
    assert full["backbone"] == cm.layer_input_bytes(llm, TINY.seq_len, 1)
    assert full["encoder"] == cm.layer_input_bytes(vit, TINY.encoder_seq_len, 1)
    model_plain = cm.layer_activation_bytes(llm, TINY.seq_len, 1)
    assert plain["backbone"] - full["backbone"] >= model_plain - cm.layer_input_bytes(
        llm, TINY.seq_len, 1
    )


@pytest.mark.slow  # six one-process runs; selective recomputation's losses: test_runtime.py
def test_selective_recomputation_drops_the_attention_scores(plain):
    """Selective: the core attention's saved tensors (its s^2 probabilities among them) go; a
    layer keeps less than without recomputation and more than with full recomputation."""
    selective = per_layer(Recompute("selective"))["backbone"]
    s2 = B * TINY.llm_heads * TINY.seq_len**2 * 2  # one bf16 [b, heads, s, s] tensor
    assert plain["backbone"] - selective >= s2
    assert selective > per_layer(Recompute("full", "uniform", 1))["backbone"]


def test_the_planner_charges_recomputation():
    """A recomputed layer's backward runs its forward again and it keeps only its input; block
    recomputation covers the first N layers of each stage only."""
    plan = ParallelPlan(1, 1, 2)
    base = JobCosts(job_of(TINY, plan, B, 4))
    full = JobCosts(job_of(TINY, plan, B, 4, recompute=Recompute("full", "uniform", 1, True)))
    for name in ("backbone_layer", "encoder_layer"):
        args = (1,) if name == "backbone_layer" else (0, 1)
        a, b = getattr(base, name)(*args), getattr(full, name)(*args)
        fwd = sum(k.total_s for k in a.fwd)
        bwd_a, bwd_b = (sum(k.total_s for k in x.bwd) for x in (a, b))
        assert bwd_b == pytest.approx(bwd_a + fwd) and b.act_bytes < a.act_bytes / 10
        assert len(b.bwd) == len(a.bwd)  # the runtime's units: one backward per forward
    from megatron_mllm.schedule.assemble import megatron_backbone

    block = JobCosts(job_of(TINY, plan, B, 4, recompute=Recompute("full", "block", 1)))
    stages, layers = megatron_backbone(block, 0.0, even=True)
    plain_stages, _ = megatron_backbone(base, 0.0, even=True)
    layer = base.backbone_layer(1)
    for key, stage in stages.items():
        saved = plain_stages[key].act_bytes - stage.act_bytes
        assert saved == pytest.approx(layer.act_bytes - block.backbone_layer(1, True).act_bytes)
    assert layers == (2, 2)
