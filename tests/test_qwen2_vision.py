"""The native-resolution vision towers of Qwen2-VL and Qwen2.5-VL from megatron-core parts: on
Hugging Face's weights each gives transformers' own tower's output for images of different
sizes in one micro-batch, and no image's output depends on another's (nor, in Qwen2.5-VL's
windowed layers alone, a window's on another window's)."""

from dataclasses import replace

import pytest
import torch

from megatron_mllm.models.qwen2_vision import Qwen2VisionSpec, vision_position_ids, window_order
from megatron_mllm.runtime.assembly.launch import spawn

SPEC = Qwen2VisionSpec(layers=2, hidden=32, heads=2, ffn=128, out_hidden=48, patch_size=4)
# Qwen2.5-VL's: RMSNorm, gated SiLU MLP, windows of 2 x 2 merged tokens (16 px), layer 1 full.
SPEC25 = replace(SPEC, layers=3, ffn=40, norm="RMSNorm", gated=True, activation="silu",
                 window=16, full_layers=(1,))  # fmt: skip
# (frames, rows, columns) of patches: windows of 2 x 2 merged tokens cut the 4 x 6 image into
# 2 windows and the 6 x 6 one into 4, of 4, 2, 2 and 1 tokens.
GRIDS = torch.tensor([[1, 4, 4], [1, 4, 6], [1, 2, 2], [1, 6, 6]])


def _hf_tower(spec: Qwen2VisionSpec):
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )

    common = dict(depth=spec.layers, num_heads=spec.heads, spatial_merge_size=spec.merge,
                  patch_size=spec.patch_size,
                  temporal_patch_size=spec.temporal_patch_size)  # fmt: skip
    text = dict(hidden_size=spec.out_hidden, num_attention_heads=4, num_hidden_layers=1,
                intermediate_size=64, vocab_size=64, num_key_value_heads=4)  # fmt: skip
    if spec.gated:
        vision = dict(common, hidden_size=spec.hidden, out_hidden_size=spec.out_hidden,
                      intermediate_size=spec.ffn, window_size=spec.window,
                      fullatt_block_indexes=list(spec.full_layers))  # fmt: skip
        config = Qwen2_5_VLConfig(vision_config=vision, text_config=text)
        return Qwen2_5_VLForConditionalGeneration(config).eval()
    vision = dict(common, embed_dim=spec.hidden, hidden_size=spec.out_hidden)
    return Qwen2VLForConditionalGeneration(Qwen2VLConfig(vision_config=vision, text_config=text))


def _both(rank: int, world: int, spec: Qwen2VisionSpec) -> dict:
    from megatron_mllm.models.hf_qwen2vl import config_from_qwen2vl, qwen2vl_to_canonical
    from megatron_mllm.models.qwen2_vision import Qwen2VisionTower
    from megatron_mllm.models.weights import load_full_state
    from megatron_mllm.parallel.groups import build_colocated_groups
    from megatron_mllm.parallel.plans import ParallelPlan
    from megatron_mllm.runtime.assembly.bootstrap import init_rank

    init_rank(rank, world, 0, 60.0)
    torch.manual_seed(0)
    hf = _hf_tower(spec).eval()
    for p in hf.model.visual.parameters():  # RMSNorm weights start at one: make them matter
        p.data += 0.1 * torch.randn_like(p)
    cfg = config_from_qwen2vl(hf.config, text_len=8)
    assert cfg.vision_spec() == spec
    one = ParallelPlan(1, 1, 1)
    pg = build_colocated_groups(one, one, 1, 0).backbone
    ours = Qwen2VisionTower(spec, pg).eval()
    load_full_state(ours, qwen2vl_to_canonical(hf.state_dict(), cfg), 0, 1)  # canonical names
    n = int((GRIDS[:, 1] * GRIDS[:, 2]).sum())
    patches = torch.randn(n, spec.patch_dim)
    with torch.no_grad():
        mine = ours(patches, GRIDS).squeeze(1)
        theirs = hf.model.visual(patches, grid_thw=GRIDS).pooler_output
        first = int(GRIDS[0, 1] * GRIDS[0, 2])
        other = patches.clone()
        other[first:] = torch.randn(n - first, spec.patch_dim)  # the other images changed
        changed = ours(other, GRIDS).squeeze(1)
        windowed = _windowed_only(ours, spec, patches, GRIDS)
    return {"ours": mine, "theirs": theirs, "changed": changed, **windowed,
            "units": _layer_and_kernel_units(ours, spec, pg, patches)}  # fmt: skip


def _layer_and_kernel_units(ours, spec, pg, patches) -> dict:
    """(output, input gradient, parameter gradients) of the tower as layer units and, on the
    same weights, as kernel units (eight a layer, the merger in two)."""
    from megatron_mllm.models.qwen2_vision import Qwen2VisionStage

    kernels = Qwen2VisionStage(spec, pg, kernel_units=True).eval()
    kernels.load_state_dict(ours.state_dict())
    weight = torch.randn(int((GRIDS[:, 1] * GRIDS[:, 2]).sum()) // spec.merge**2, spec.out_hidden)
    out = {"num_units": (ours.num_units, kernels.num_units)}
    for name, tower in (("layer", ours), ("kernel", kernels)):
        x = patches.clone().requires_grad_(True)
        y = tower(x, GRIDS).squeeze(1)
        (y * weight).sum().backward()
        out[name] = (y.detach(), x.grad, {k: p.grad for k, p in tower.named_parameters()})
    return out


def _windowed_only(ours, spec, patches, grids) -> dict:
    """With no full-attention layer: the second image's (2 x 3 merged tokens, in two windows)
    tokens of its first window before and after the patches of its other window change, and
    those of the other window."""
    if not spec.window:
        return {}
    ours.spec = replace(spec, full_layers=())
    t = int(grids[0, 1] * grids[0, 2]) // 4  # the second image's first merged token
    same, other = [t, t + 1, t + 3, t + 4], [t + 2, t + 5]  # its windows (row-major tokens)
    before = ours(patches, grids).squeeze(1)
    changed = patches.clone()
    for token in other:  # the input is in merge-window order: 4 patches a merged token
        changed[4 * token : 4 * token + 4] += 1.0
    after = ours(changed, grids).squeeze(1)
    ours.spec = spec
    return {
        "window_same": (before[same], after[same]),
        "window_other": (before[other], after[other]),
    }


@pytest.mark.parametrize("spec", [SPEC, SPEC25], ids=["qwen2-vl", "qwen2.5-vl"])
def test_the_tower_gives_transformers_output_for_images_of_different_sizes(spec):
    out = spawn(_both, 1, spec)[0]
    windows = int((GRIDS[:, 1] * GRIDS[:, 2]).sum()) // spec.merge**2
    assert out["ours"].shape == (windows, spec.out_hidden)
    torch.testing.assert_close(out["ours"], out["theirs"], rtol=1e-4, atol=1e-5)
    first = int(GRIDS[0, 1] * GRIDS[0, 2]) // spec.merge**2
    assert torch.equal(out["changed"][:first], out["ours"][:first])  # attention within an image
    assert not torch.equal(out["changed"][first:], out["ours"][first:])
    if spec.window:  # windowed layers alone: a window does not see another
        before, after = out["window_same"]
        assert torch.equal(before, after)
        assert not torch.equal(*out["window_other"])
    units = out["units"]
    assert units["num_units"] == (1 + spec.layers + 1, 1 + 8 * spec.layers + 2)
    (y, dx, grads), (yk, dxk, grads_k) = units["layer"], units["kernel"]
    torch.testing.assert_close(yk, y, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dxk, dx, rtol=1e-6, atol=1e-6)
    assert grads.keys() == grads_k.keys()
    for name, g in grads.items():
        torch.testing.assert_close(grads_k[name], g, rtol=1e-6, atol=1e-6, msg=name)


def test_patches_are_in_merge_window_order():
    pos = vision_position_ids(torch.tensor([[1, 2, 4]]), merge=2)
    assert pos.tolist() == [[0, 0], [0, 1], [1, 0], [1, 1], [0, 2], [0, 3], [1, 2], [1, 3]]


def test_windows_tile_each_image_from_its_top_left():
    order, lengths = window_order(torch.tensor([[1, 4, 6], [1, 2, 2]]), merge=2, side=2)
    # the first image's 2 x 3 merged tokens: window (0-1, 0-1), then (0-1, 2); then the second's
    assert order.tolist() == [0, 1, 3, 4, 2, 5, 6]
    assert lengths.tolist() == [4, 2, 1]


def _tp2(rank: int, world: int, spec: Qwen2VisionSpec) -> dict | None:
    """The tower at TP 2 (heads and MLP split; patch embedding, norms and merger whole) on
    transformers' weights: its output, and its gradients reassembled, beside transformers'."""
    import torch.distributed as dist

    from megatron_mllm.models.hf_qwen2vl import config_from_qwen2vl, qwen2vl_to_canonical
    from megatron_mllm.models.qwen2_vision import Qwen2VisionStage
    from megatron_mllm.models.weights import assemble_grads, grad_shards, load_full_state
    from megatron_mllm.parallel.groups import build_colocated_groups
    from megatron_mllm.parallel.plans import ParallelPlan
    from megatron_mllm.runtime.assembly.bootstrap import init_rank

    init_rank(rank, world, 0, 60.0)
    torch.manual_seed(0)  # the same model and inputs on both ranks
    hf = _hf_tower(spec).eval()
    for p in hf.model.visual.parameters():
        p.data += 0.1 * torch.randn_like(p)
    cfg = config_from_qwen2vl(hf.config, text_len=8)
    plan = ParallelPlan(1, 2, 1)
    ours = Qwen2VisionStage(spec, build_colocated_groups(plan, plan, world, rank).backbone, 2)
    canonical = qwen2vl_to_canonical(hf.state_dict(), cfg)
    load_full_state(ours, canonical, rank, 2)
    patches = torch.randn(int((GRIDS[:, 1] * GRIDS[:, 2]).sum()), spec.patch_dim)
    mine, theirs = ours(patches, GRIDS).squeeze(1), hf.model.visual(patches, grid_thw=GRIDS)
    theirs = theirs.pooler_output
    weights = torch.randn_like(theirs)
    (mine * weights).sum().backward()
    (theirs * weights).sum().backward()
    shards = [None] * world
    dist.all_gather_object(shards, grad_shards(ours, rank))
    if rank:
        return None
    hf_grads = {
        k: torch.zeros_like(p) if p.grad is None else p.grad for k, p in hf.named_parameters()
    }
    expected = {k: v for k, v in qwen2vl_to_canonical(hf_grads, cfg).items() if k in shards[0]}
    shapes = {k: canonical[k].shape for k in expected}
    grads = assemble_grads(shards, shapes, dict.fromkeys(shapes, 2))
    return {"ours": mine.detach(), "theirs": theirs.detach(), "grads": grads, "expected": expected}


@pytest.mark.parametrize("spec", [SPEC, SPEC25], ids=["qwen2-vl", "qwen2.5-vl"])
def test_the_tower_at_tp2_gives_transformers_output_and_gradients(spec):
    out = spawn(_tp2, 2, spec)[0]
    torch.testing.assert_close(out["ours"], out["theirs"], rtol=1e-4, atol=1e-5)
    assert out["grads"].keys() == out["expected"].keys()
    for name, grad in out["expected"].items():
        torch.testing.assert_close(out["grads"][name], grad, rtol=1e-4, atol=1e-5, msg=name)
