"""Model sizes for the MLLM built from megatron-core parts (one config for tiny CPU models and
the paper's sizes alike)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_mllm.errors import ConfigError


@dataclass(frozen=True)
class MLLMConfig:
    """A ViT encoder (patch embedding + transformer), a 2-layer MLP projector, a GPT backbone.

    The backbone sees `num_patches` image tokens followed by `text_len` text tokens; the loss is
    on the text tokens only.
    """

    image_size: int = 32
    patch_size: int = 8
    channels: int = 3
    vit_layers: int = 2
    vit_hidden: int = 64
    vit_heads: int = 4
    vit_ffn: int | None = None
    llm_layers: int = 4
    llm_hidden: int = 64
    llm_heads: int = 4
    llm_ffn: int | None = None
    vocab_size: int = 128
    text_len: int = 16

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def patch_dim(self) -> int:
        return self.channels * self.patch_size**2

    @property
    def seq_len(self) -> int:
        return self.num_patches + self.text_len

    def transformer_specs(self):
        """(encoder, backbone) shapes for the schedule core's cost model."""
        from megatron_mllm.schedule.specs import TransformerSpec

        vit_ffn, llm_ffn = self.vit_ffn or 4 * self.vit_hidden, self.llm_ffn or 4 * self.llm_hidden
        return (
            TransformerSpec(
                "vit",
                self.vit_layers,
                self.vit_hidden,
                vit_ffn,
                self.vit_heads,
                causal=False,
                seq_len=self.num_patches,
            ),
            TransformerSpec(
                "llm",
                self.llm_layers,
                self.llm_hidden,
                llm_ffn,
                self.llm_heads,
                causal=True,
                vocab_size=self.vocab_size,
            ),
        )

    def validate(self, tp: int = 1, encoder_tp: int = 1) -> None:
        if self.image_size % self.patch_size:
            raise ConfigError(
                f"image size {self.image_size} is not a multiple of patch size {self.patch_size}"
            )
        for name, hidden, heads, t in (
            ("vit", self.vit_hidden, self.vit_heads, encoder_tp),
            ("llm", self.llm_hidden, self.llm_heads, tp),
        ):
            if hidden % heads:
                raise ConfigError(f"{name} hidden {hidden} is not divisible by {heads} heads")
            if heads % t:
                raise ConfigError(f"{name} heads {heads} are not divisible by TP {t}")
        if self.vocab_size % tp:
            raise ConfigError(f"vocab size {self.vocab_size} is not divisible by TP {tp}")


TINY = MLLMConfig()
# The benchmark's model: encoder about 30% of the compute (measured), still fast on 2 cores.
BENCH = MLLMConfig(
    image_size=64,
    patch_size=8,
    vit_layers=6,
    vit_hidden=384,
    vit_heads=6,
    llm_layers=8,
    llm_hidden=384,
    llm_heads=6,
    vocab_size=1024,
    text_len=64,
)


def transformer_config(cfg: MLLMConfig, part: str, tp: int, pp: int, **overrides):
    """A megatron-core TransformerConfig for the encoder ("vit") or backbone ("llm")."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    vit = part == "vit"
    kwargs = dict(
        num_layers=cfg.vit_layers if vit else cfg.llm_layers,
        hidden_size=cfg.vit_hidden if vit else cfg.llm_hidden,
        num_attention_heads=cfg.vit_heads if vit else cfg.llm_heads,
        ffn_hidden_size=(cfg.vit_ffn if vit else cfg.llm_ffn)
        or 4 * (cfg.vit_hidden if vit else cfg.llm_hidden),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        batch_p2p_comm=False,  # gloo matches p2p in posting order; see MEGATRON_CORE_ON_CPU.md
        batch_p2p_sync=False,
        perform_initialization=True,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)
