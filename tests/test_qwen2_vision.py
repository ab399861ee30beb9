"""Qwen2-VL's native-resolution vision tower from megatron-core parts: on Hugging Face's weights
it gives transformers' own tower's output for images of different sizes in one micro-batch,
and no image's output depends on another's."""

import torch

from megatron_mllm.models.qwen2_vision import Qwen2VisionSpec, vision_position_ids
from megatron_mllm.runtime.assembly.launch import spawn

SPEC = Qwen2VisionSpec(layers=2, hidden=32, heads=2, out_hidden=48, patch_size=4)
GRIDS = torch.tensor([[1, 4, 4], [1, 4, 6], [1, 2, 2]])  # (frames, rows, columns) of patches


def _both(rank: int, world: int) -> dict:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from megatron_mllm.models.hf_qwen2vl import config_from_qwen2vl, qwen2vl_to_canonical
    from megatron_mllm.models.qwen2_vision import Qwen2VisionTower
    from megatron_mllm.models.weights import load_full_state
    from megatron_mllm.parallel.groups import build_colocated_groups
    from megatron_mllm.parallel.plans import ParallelPlan
    from megatron_mllm.runtime.assembly.bootstrap import init_rank

    init_rank(rank, world, 0, 60.0)
    torch.manual_seed(0)
    vision = dict(depth=SPEC.layers, embed_dim=SPEC.hidden, hidden_size=SPEC.out_hidden,
                  num_heads=SPEC.heads, spatial_merge_size=SPEC.merge, patch_size=SPEC.patch_size,
                  temporal_patch_size=SPEC.temporal_patch_size)  # fmt: skip
    text = dict(hidden_size=SPEC.out_hidden, num_attention_heads=4, num_hidden_layers=1,
                intermediate_size=64, vocab_size=64, num_key_value_heads=4)  # fmt: skip
    hf = Qwen2VLForConditionalGeneration(Qwen2VLConfig(vision_config=vision, text_config=text))
    hf = hf.eval()
    cfg = config_from_qwen2vl(hf.config, text_len=8)
    assert cfg.vision_spec() == SPEC
    one = ParallelPlan(1, 1, 1)
    ours = Qwen2VisionTower(SPEC, build_colocated_groups(one, one, 1, 0).backbone).eval()
    load_full_state(ours, qwen2vl_to_canonical(hf.state_dict(), cfg), 0, 1)  # by canonical names
    n = int((GRIDS[:, 1] * GRIDS[:, 2]).sum())
    patches = torch.randn(n, SPEC.patch_dim)
    with torch.no_grad():
        mine = ours(patches, GRIDS).squeeze(1)
        theirs = hf.model.visual(patches, grid_thw=GRIDS).pooler_output
        first = int(GRIDS[0, 1] * GRIDS[0, 2])
        other = patches.clone()
        other[first:] = torch.randn(n - first, SPEC.patch_dim)  # the other images changed
        changed = ours(other, GRIDS).squeeze(1)
    return {"ours": mine, "theirs": theirs, "changed": changed}


def test_the_tower_gives_transformers_output_for_images_of_different_sizes():
    out = spawn(_both, 1)[0]
    windows = int((GRIDS[:, 1] * GRIDS[:, 2]).sum()) // SPEC.merge**2
    assert out["ours"].shape == (windows, SPEC.out_hidden)
    torch.testing.assert_close(out["ours"], out["theirs"], rtol=1e-4, atol=1e-5)
    first = int(GRIDS[0, 1] * GRIDS[0, 2]) // SPEC.merge**2
    assert torch.equal(out["changed"][:first], out["ours"][:first])  # attention within an image
    assert not torch.equal(out["changed"][first:], out["ours"][first:])


def test_patches_are_in_merge_window_order():
    pos = vision_position_ids(torch.tensor([[1, 2, 4]]), merge=2)
    assert pos.tolist() == [[0, 0], [0, 1], [1, 0], [1, 1], [0, 2], [0, 3], [1, 2], [1, 3]]
