"""Transformer shapes of the paper's models (DESIGN section 5), and YAML for any other."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from megatron_mllm.errors import ConfigError


@dataclass(frozen=True)
class TransformerSpec:
    """Shape of a transformer. `causal` is True for language models, False for ViTs."""

    name: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    causal: bool
    vocab_size: int = 0
    seq_len: int | None = None  # None: the run's --seq-len
    patch_dim: int = 3 * 14 * 14  # encoders: values per image patch (channels x patch^2)

    @property
    def params_per_layer(self) -> int:
        h, f = self.hidden_size, self.ffn_hidden_size
        return 4 * h * h + 2 * h * f + 9 * h + f  # QKV+proj, MLP, biases and two norms

    @property
    def num_params(self) -> int:
        return self.num_layers * self.params_per_layer + self.vocab_size * self.hidden_size


def _vit(name: str, width: int, mlp: int, heads: int) -> TransformerSpec:
    return TransformerSpec(name, 48, width, mlp, heads, causal=False)


def _gpt(name: str, width: int, layers: int, heads: int, vocab: int) -> TransformerSpec:
    return TransformerSpec(name, layers, width, 4 * width, heads, causal=True, vocab_size=vocab)


BUILTIN_MODELS: dict[str, TransformerSpec] = {
    s.name: s
    for s in (
        _vit("vit-3b", 2304, 9216, 18),
        _vit("vit-5b", 3072, 12288, 24),
        _vit("vit-11b", 4096, 16384, 32),
        _vit("vit-22b", 6144, 24576, 48),
        _gpt("gpt-11b", 3072, 80, 24, 51200),
        _gpt("llama-70b", 8192, 80, 64, 32000),
        _gpt("gpt-175b", 12288, 96, 96, 51200),
        # Qwen2.5-VL-72B's parts. Gated MLPs (three matrices of width f) as two of width 1.5 f;
        # the tower costed on its nominal 448 x 448 image (32 x 32 patches of 14).
        TransformerSpec("qwen2.5-vl-vit", 32, 1280, 5130, 16, False, seq_len=1024, patch_dim=1176),
        TransformerSpec("qwen2-72b", 80, 8192, 44352, 64, True, vocab_size=152064),
    )
}

_REQUIRED = ("num_layers", "hidden_size", "num_heads")


def load_model(name_or_path: str, *, encoder: bool) -> TransformerSpec:
    """A built-in model by name, or a YAML file with num_layers, hidden_size, num_heads, ..."""
    if name_or_path in BUILTIN_MODELS:
        return BUILTIN_MODELS[name_or_path]
    path = Path(name_or_path)
    if not name_or_path.endswith((".yaml", ".yml")) or not path.is_file():
        known = ", ".join(BUILTIN_MODELS)
        raise ConfigError(
            f"unknown model '{name_or_path}'; use one of {known}, or a path to a .yaml file"
        )
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        line = getattr(getattr(err, "problem_mark", None), "line", None)
        where = f" at line {line + 1}" if line is not None else ""
        raise ConfigError(f"{path}: malformed YAML{where}; expected a mapping of keys") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a YAML mapping with keys {', '.join(_REQUIRED)}")
    allowed = {f.name for f in fields(TransformerSpec)} - {"name", "causal"}
    unknown = set(raw) - allowed
    if unknown:
        raise ConfigError(
            f"{path}: unknown key(s) {', '.join(sorted(unknown))}; "
            f"allowed: {', '.join(sorted(allowed))}"
        )
    missing = [k for k in _REQUIRED if k not in raw]
    if missing:
        raise ConfigError(f"{path}: missing key(s) {', '.join(missing)}")
    for key, value in raw.items():
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ConfigError(f"{path}: {key} is {value!r}; it must be a positive integer")
    hidden = raw["hidden_size"]
    if hidden % raw["num_heads"]:
        raise ConfigError(
            f"{path}: hidden_size {hidden} is not divisible by num_heads {raw['num_heads']}"
        )
    return TransformerSpec(
        name=path.stem,
        num_layers=raw["num_layers"],
        hidden_size=hidden,
        ffn_hidden_size=raw.get("ffn_hidden_size") or 4 * hidden,
        num_heads=raw["num_heads"],
        causal=not encoder,
        vocab_size=0 if encoder else raw.get("vocab_size") or 32000,
        seq_len=raw.get("seq_len"),
    )
