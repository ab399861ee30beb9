"""megatron-core's own LLaVAModel layout <-> our checkpoints: a tiny LLaVAModel built here and
saved as Megatron-LM saves it (its arguments pickled in the common state) is imported with
equal logits, exported, and loaded back by a fresh LLaVAModel with equal weights."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_mllm.errors import ConfigError
from megatron_mllm.models import mcore_llava
from megatron_mllm.runtime.assembly.launch import spawn

ROOT = Path(__file__).resolve().parents[1]
TOOL = [sys.executable, str(ROOT / "tools" / "convert_mcore_llava.py")]
FLAGS = [
    "--encoder-arch", "clip", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
    "--group-query-attention", "--num-query-groups", "2", "--seq-length", "6",
]  # fmt: skip
TEXT = 6


def _cfg(flags=FLAGS):
    from megatron_mllm.training.arguments import build_parser
    from megatron_mllm.training.model_args import model_config

    return model_config(build_parser().parse_args(flags))


def _inputs(cfg):
    torch.manual_seed(1)
    images = torch.randn(2, 3, cfg.image_size, cfg.image_size)
    return images, torch.randint(1, cfg.vocab_size, (2, TEXT))


def _llava(seed: int):
    """One rank's LLaVAModel of FLAGS, every weight distinctive (norms included)."""
    from megatron_mllm.runtime.assembly.bootstrap import init_rank
    from megatron_mllm.training.convert_mcore_llava import mpu_one_rank

    init_rank(0, 1, seed, 120.0)
    model = mcore_llava.build_llava_model(_cfg(), mpu_one_rank()).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2).add_(1.0 if p.ndim == 1 else 0.0)
    return model


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def save_as_megatron_lm(rank: int, world: int, root: str):
    """(logits, weights) of a LLaVAModel saved under `root` at iteration 5, Megatron-LM-style."""
    from megatron.core import dist_checkpointing
    from megatron.core.models.multimodal.llava_model import DEFAULT_IMAGE_TOKEN_INDEX

    from megatron_mllm.models.stages import causal_mask

    model, cfg = _llava(seed=7), _cfg()
    images, text = _inputs(cfg)
    ids = torch.cat([torch.full((2, 1), DEFAULT_IMAGE_TOKEN_INDEX), text], dim=1)
    mask = causal_mask(cfg.image_tokens + TEXT)
    with torch.no_grad():
        logits, _ = model(images, ids, torch.arange(ids.shape[1]).expand_as(ids), mask)
    path = Path(root) / "iter_0000005"
    path.mkdir(parents=True)
    state = {
        "model": model.sharded_state_dict(),
        "args": argparse.Namespace(lr=1e-4, ckpt_format="torch_dist"),  # never unpickled
        "iteration": 5,
        "checkpoint_version": 3.0,
    }
    dist_checkpointing.save(state, str(path))
    (Path(root) / "latest_checkpointed_iteration.txt").write_text("5")
    return logits, _weights(model)


def load_as_megatron_lm(rank: int, world: int, root: str) -> dict[str, torch.Tensor]:
    """The weights a fresh LLaVAModel loads from the checkpoint under `root`/release."""
    from megatron.core import dist_checkpointing

    model = _llava(seed=11)
    state = {"model": model.sharded_state_dict()}  # as Megatron-LM's load_checkpoint asks
    loaded = dist_checkpointing.load(state, str(Path(root) / "release"))
    assert loaded["iteration"] == 0 and loaded["checkpoint_version"] == 3.0
    model.load_state_dict(loaded["model"])
    return _weights(model)


def _tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*TOOL, *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_lm_llava")
    logits, weights = spawn(save_as_megatron_lm, 1, str(root))[0]
    return root, logits, weights


@pytest.mark.slow  # four one-rank processes
def test_megatron_core_llava_imports_with_equal_logits_and_exports_back(upstream, tmp_path):
    from megatron_mllm.training.convert_hf import checkpoint_logits

    root, logits, weights = upstream
    ours = tmp_path / "ours"
    done = _tool("import", "--load-dir", str(root), "--save-dir", str(ours), *FLAGS)
    assert done.returncode == 0, done.stderr
    images, text = _inputs(_cfg())
    mine = spawn(checkpoint_logits, 1, str(ours), 1, images, text)[0]
    torch.testing.assert_close(mine, logits, atol=1e-5, rtol=1e-5)

    back = tmp_path / "back"
    done = _tool("export", "--load-dir", str(ours), "--save-dir", str(back))
    assert done.returncode == 0, done.stderr
    assert (back / "latest_checkpointed_iteration.txt").read_text() == "release"
    reloaded = spawn(load_as_megatron_lm, 1, str(back))[0]
    assert reloaded.keys() == weights.keys()
    for name, value in weights.items():
        torch.testing.assert_close(reloaded[name], value, atol=0, rtol=0, msg=name)


@pytest.mark.slow  # a conversion process
def test_flags_that_do_not_match_the_checkpoint_are_refused_in_one_line(upstream, tmp_path):
    root, _, _ = upstream
    for flags, says in (
        (["--ffn-hidden-size", "96"], "where the model flags give"),
        (["--num-layers", "3"], "stacks 4 layers where the model flags give 3"),
    ):
        done = _tool("import", "--load-dir", str(root), "--save-dir", str(tmp_path / "x"),
                     *FLAGS, *flags)  # fmt: skip
        assert done.returncode == 2 and says in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert not (tmp_path / "x" / "latest_checkpointed_iteration.txt").exists()


def _named(cfg) -> dict[str, torch.Tensor]:
    """A LLaVAModel-named state of `cfg` (local spec names), small random tensors."""
    g = torch.Generator().manual_seed(0)
    h, L, V = cfg.vit_hidden, cfg.llm_layers, cfg.vit_layers
    out = {
        "vision_model.conv1.weight": torch.randn(h, 3, cfg.patch_size, cfg.patch_size, generator=g),
        "vision_model.position_embeddings.weight": torch.randn(cfg.encoder_seq_len, h, generator=g),
        "vision_model.class_token": torch.randn(1, 1, h, generator=g),
        "vision_model.ln_pre.weight": torch.randn(h, generator=g),
        "language_model.output_layer.weight": torch.randn(4, 4, generator=g),
        "vision_projection.encoder.linear_fc1.weight": torch.randn(4, h, generator=g),
    }
    for i in range(L):
        out[f"language_model.decoder.layers.{i}.input_layernorm.weight"] = torch.randn(4)
        out[f"language_model.decoder.layers.{i}.pre_mlp_layernorm.weight"] = torch.randn(4)
    for i in range(V):
        out[f"vision_model.decoder.layers.{i}.input_layernorm.bias"] = torch.randn(4)
    return out


def test_transformer_engine_names_map_like_the_local_specs():
    cfg = _cfg()
    local = _named(cfg)
    te = {}
    for name, value in local.items():
        name = name.replace("input_layernorm.", "self_attention.linear_qkv.layer_norm_")
        te[name.replace("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_")] = value
    te["language_model.output_layer._extra_state"] = torch.empty(0)
    canonical = mcore_llava.to_canonical(te, cfg)
    assert canonical.keys() == mcore_llava.to_canonical(local, cfg).keys()
    assert canonical["encoder.pos_embed"].shape == (cfg.encoder_seq_len, 1, cfg.vit_hidden)
    assert canonical["encoder.patch_embed.weight"].shape == (cfg.vit_hidden, cfg.patch_dim)
    back = mcore_llava.from_canonical(canonical, cfg)
    assert back.keys() == local.keys()
    for name, value in local.items():
        assert torch.equal(back[name], value), name


def test_unmapped_models_and_tensors_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="one CLIP tower"):
        mcore_llava.check_mappable(_cfg(["--encoder-arch", "vit"]))
    with pytest.raises(ConfigError, match="1-D RoPE"):
        mcore_llava.check_mappable(_cfg([*FLAGS, "--mrope-section", "2", "3", "3"]))
    with pytest.raises(ConfigError, match="vision_model.radio_embedder.weight has no place"):
        mcore_llava.to_canonical({"vision_model.radio_embedder.weight": torch.zeros(1)}, _cfg())
    stacked = {"language_model.decoder.layers.mlp.linear_fc2.weight": torch.zeros(3, 2, 2)}
    with pytest.raises(ConfigError, match="stacks 3 layers"):
        mcore_llava.unstack_layers(stacked, _cfg())


def test_a_folder_without_a_megatron_checkpoint_is_refused(tmp_path, capsys):
    from tools.convert_mcore_llava import main

    (tmp_path / "latest_checkpointed_iteration.txt").write_text("12")
    with pytest.raises(SystemExit) as stop:
        main(["import", "--load-dir", str(tmp_path), "--save-dir", str(tmp_path / "o"), *FLAGS])
    assert stop.value.code == 2
    assert "says '12' but no torch_dist checkpoint" in capsys.readouterr().err
    (tmp_path / "iter_0000012" / "mp_rank_00").mkdir(parents=True)
    with pytest.raises(SystemExit):
        main(["import", "--load-dir", str(tmp_path), "--save-dir", str(tmp_path / "o"), *FLAGS])
    assert "is a --ckpt-format torch checkpoint" in capsys.readouterr().err
