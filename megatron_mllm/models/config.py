"""Model sizes for the MLLM built from megatron-core parts (one config for tiny CPU models and
the paper's sizes alike)."""

from __future__ import annotations

from dataclasses import dataclass, replace

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
    # Encoder architecture. The defaults are our plain ViT; LLaVA's CLIP tower is
    # class token + pre-norm + quick_gelu + no patch bias + no final norm (see CLIP_VIT).
    vit_class_token: bool = False  # a learned [CLS] token first, dropped before the projector
    vit_pre_norm: bool = False  # LayerNorm on the embeddings (CLIP's pre_layrnorm)
    vit_final_norm: bool = True  # LayerNorm after the last layer
    vit_patch_bias: bool = True
    vit_activation: str = "gelu"  # or "quick_gelu"
    # Qwen2-VL's native-resolution tower (models/qwen2_vision.py) instead of the ViT: each image
    # at its own size, patches of patch_size over vit_temporal_patch frames, each vit_merge x
    # vit_merge window of patches one backbone token. image_size is then the nominal image the
    # planner costs (and the largest synthetic one).
    vit_native: bool = False
    vit_merge: int = 2
    vit_temporal_patch: int = 2
    vit_norm_eps: float = 1e-5
    # Qwen2.5-VL's tower: RMSNorm, a gated MLP (with vit_activation "silu"), and attention
    # within windows of vit_window pixels a side except in the vit_full_layers (0: no windows).
    vit_normalization: str = "LayerNorm"
    vit_swiglu: bool = False
    vit_window: int = 0
    vit_full_layers: tuple[int, ...] = ()
    projector_bias: bool = True
    # Backbone architecture (Megatron's --normalization, --swiglu, --disable-bias-linear,
    # --num-query-groups, --norm-epsilon, --rotary-base). Llama: RMSNorm + SwiGLU + no bias.
    llm_normalization: str = "LayerNorm"  # or "RMSNorm"
    llm_swiglu: bool = False
    llm_bias: bool = True
    llm_query_groups: int | None = None  # None: one per head (no grouped-query attention)
    llm_norm_eps: float = 1e-5
    rope_base: float = 10000.0
    # Qwen2's attention: biases on Q, K and V only (Megatron's --add-qkv-bias, with
    # --disable-bias-linear).
    llm_qkv_bias: bool = False
    # Qwen2-VL's multimodal RoPE (Megatron's --mrope-section T H W): the rotary frequencies in
    # three sections, over half the head dim, turned by each token's temporal, height and
    # width position (an image's tokens on their grid, text on one line). (): 1-D RoPE.
    llm_mrope_section: tuple[int, ...] = ()
    # Training-time only (no effect on the weights' shapes): Megatron's --hidden-dropout and
    # --attention-dropout, 0 by default here.
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    # More encoders (e.g. a second ViT of another size): each an MLLMConfig whose encoder fields
    # (VIT_FIELDS) describe it; their image tokens follow this encoder's in the backbone input.
    extra_encoders: tuple[MLLMConfig, ...] = ()

    @property
    def num_encoders(self) -> int:
        return 1 + len(self.extra_encoders)

    def encoder_config(self, e: int) -> MLLMConfig:
        """Encoder e's view: its encoder fields, this model's backbone (e = 0: this config)."""
        if e == 0:
            return self
        other = self.extra_encoders[e - 1]
        return replace(self, **{f: getattr(other, f) for f in VIT_FIELDS}, extra_encoders=())

    @property
    def image_tokens(self) -> int:
        """Image tokens in the backbone's input: every encoder's patches, in encoder order (a
        native-resolution tower's nominal image: its merged windows)."""
        if self.vit_native:
            return self.num_patches // self.vit_merge**2
        return sum(self.encoder_config(e).num_patches for e in range(self.num_encoders))

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def encoder_seq_len(self) -> int:
        """Tokens inside the encoder: the patches, after the class token if there is one."""
        return self.num_patches + int(self.vit_class_token)

    @property
    def patch_dim(self) -> int:
        depth = self.vit_temporal_patch if self.vit_native else 1
        return self.channels * depth * self.patch_size**2

    def native_image_spec(self):
        """How a native-resolution tower's images are cut (`data.native_images`)."""
        from megatron_mllm.data.native_images import NativeImageSpec

        return NativeImageSpec(
            self.patch_size, self.vit_merge, self.vit_temporal_patch, channels=self.channels
        )

    def tower_shape(self):
        """The native tower's shape as its cost depends on it (`schedule.patch_loads`)."""
        from megatron_mllm.schedule.patch_loads import TowerShape

        factor = self.patch_size * self.vit_merge
        window = self.vit_window // factor if self.vit_window else 0
        return TowerShape(
            self.vit_hidden,
            self.vit_ffn or 4 * self.vit_hidden,
            self.vit_layers,
            self.vit_swiglu,
            self.vit_merge,
            window,
            len(self.vit_full_layers),
        )

    def vision_spec(self):
        """The native-resolution tower's shape (`models.qwen2_vision.Qwen2VisionSpec`)."""
        from megatron_mllm.models.qwen2_vision import Qwen2VisionSpec

        return Qwen2VisionSpec(
            layers=self.vit_layers,
            hidden=self.vit_hidden,
            heads=self.vit_heads,
            ffn=self.vit_ffn,
            out_hidden=self.llm_hidden,
            patch_size=self.patch_size,
            temporal_patch_size=self.vit_temporal_patch,
            merge=self.vit_merge,
            channels=self.channels,
            norm=self.vit_normalization,
            gated=self.vit_swiglu,
            activation=self.vit_activation,
            window=self.vit_window,
            full_layers=self.vit_full_layers,
        )

    @property
    def image_grid(self) -> tuple[int, int]:
        """An image's tokens in the backbone as (rows, columns) of its patch grid (a
        native-resolution tower's nominal image: of its merged windows)."""
        side = self.image_size // self.patch_size // (self.vit_merge if self.vit_native else 1)
        return side, side

    @property
    def seq_len(self) -> int:
        return self.image_tokens + self.text_len

    def num_params(self) -> tuple[int, int]:
        """(every encoder + projector, backbone) parameter counts of the unsharded model."""
        extra = sum(self.encoder_config(e).num_params()[0] for e in range(1, self.num_encoders))
        h, f = self.vit_hidden, self.vit_ffn or 4 * self.vit_hidden
        vit = self.vit_layers * (4 * h * h + (3 if self.vit_swiglu else 2) * h * f + 9 * h + f)
        vit += (self.patch_dim + self.encoder_seq_len + int(self.vit_patch_bias)) * h
        vit += (int(self.vit_class_token) + 2 * self.vit_pre_norm + 2 * self.vit_final_norm) * h
        out = self.llm_hidden
        vit += h * out + out * out + 2 * out * int(self.projector_bias)
        h, f = self.llm_hidden, self.llm_ffn or 4 * self.llm_hidden
        kv = (self.llm_query_groups or self.llm_heads) * (h // self.llm_heads)
        up = (2 if self.llm_swiglu else 1) * f
        norm = h * (1 if self.llm_normalization == "RMSNorm" else 2)
        layer = 2 * h * h + 2 * h * kv + up * h + f * h + 2 * norm
        if self.llm_bias:
            layer += h + 2 * kv + h + up + h
        elif self.llm_qkv_bias:
            layer += h + 2 * kv
        return vit + extra, self.llm_layers * layer + 2 * self.vocab_size * h + norm

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
                patch_dim=self.patch_dim,
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

    def encoder_name(self, e: int) -> str:
        """Encoder e's model name in the schedule core (and in measured-times files)."""
        return "vit" if e == 0 else f"vit{e}"

    def encoder_specs(self) -> tuple:
        """Every encoder's shape for the schedule core's cost model, in encoder order."""
        specs = []
        for e in range(self.num_encoders):
            vit = self.encoder_config(e).transformer_specs()[0]
            specs.append(replace(vit, name=self.encoder_name(e)))
        return tuple(specs)

    def validate(self, tp: int = 1, encoder_tp: int = 1, sequence_parallel: bool = False) -> None:
        """One ConfigError line for the first shape that cannot be split as asked."""
        for e in range(1, self.num_encoders):
            self.encoder_config(e).validate(tp, encoder_tp)
        if sequence_parallel and tp > 1 and self.seq_len % tp:
            raise ConfigError(
                f"sequence parallelism splits the {self.seq_len}-token sequence "
                f"({self.image_tokens} image + {self.text_len} text) over TP {tp}; choose "
                f"--seq-length so that the total is divisible by {tp}"
            )
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
        groups = self.llm_query_groups or self.llm_heads
        if self.llm_heads % groups or groups % tp:
            raise ConfigError(
                f"llm query groups {groups} must divide {self.llm_heads} heads and be "
                f"divisible by TP {tp}"
            )
        if self.vit_activation not in ("gelu", "quick_gelu", "silu"):
            raise ConfigError(
                f"encoder activation '{self.vit_activation}' is not one of gelu, quick_gelu, silu"
            )
        if self.llm_normalization not in ("LayerNorm", "RMSNorm"):
            raise ConfigError(
                f"normalization '{self.llm_normalization}' is not one of LayerNorm, RMSNorm"
            )
        self._validate_mrope()
        self._validate_native()

    def _validate_native(self) -> None:
        qwen25 = (self.vit_normalization, self.vit_swiglu, self.vit_window, self.vit_full_layers)
        if not self.vit_native and qwen25 != ("LayerNorm", False, 0, ()):
            raise ConfigError(
                "RMSNorm, a gated MLP and attention windows in the encoder are Qwen2.5-VL's "
                "tower's; give --encoder-arch qwen2.5vl"
            )
        if not self.vit_native:
            return
        factor = self.patch_size * self.vit_merge
        if self.image_size % factor:
            raise ConfigError(
                f"the native-resolution tower's nominal image {self.image_size} is not a "
                f"multiple of patch x merge = {factor}"
            )
        if self.extra_encoders:
            raise ConfigError("a native-resolution tower runs alone; drop --extra-encoder")
        if self.vit_window and self.vit_window % factor:
            raise ConfigError(
                f"the tower's attention window {self.vit_window} px is not a multiple of "
                f"patch x merge = {factor}"
            )
        wrong = [i for i in self.vit_full_layers if not 0 <= i < self.vit_layers]
        if wrong:
            raise ConfigError(
                f"full-attention layers {wrong} are not among the tower's {self.vit_layers} "
                f"layers (0 to {self.vit_layers - 1})"
            )

    def _validate_mrope(self) -> None:
        if not self.llm_mrope_section:
            return
        half = self.llm_hidden // self.llm_heads // 2
        section = self.llm_mrope_section
        if len(section) != 3 or min(section) < 0 or sum(section) != half:
            raise ConfigError(
                f"--mrope-section {' '.join(map(str, section))}: give three sizes (temporal, "
                f"height, width) summing to half the head dim, {half}"
            )
        if self.extra_encoders:
            raise ConfigError("--mrope-section places one encoder's images; drop --extra-encoder")


VIT_FIELDS = (
    "image_size",
    "patch_size",
    "channels",
    "vit_layers",
    "vit_hidden",
    "vit_heads",
    "vit_ffn",
    "vit_class_token",
    "vit_pre_norm",
    "vit_final_norm",
    "vit_patch_bias",
    "vit_activation",
    "vit_norm_eps",
    "vit_normalization",
    "vit_swiglu",
    "vit_window",
    "vit_full_layers",
    "projector_bias",
)

TINY = MLLMConfig()
# LLaVA-1.5's parts: CLIP vision tower, Llama backbone (sizes come from the checkpoint).
CLIP_VIT = dict(
    vit_class_token=True,
    vit_pre_norm=True,
    vit_final_norm=False,
    vit_patch_bias=False,
    vit_activation="quick_gelu",
)
LLAMA = dict(llm_normalization="RMSNorm", llm_swiglu=True, llm_bias=False, llm_norm_eps=1e-6)
# Qwen2-VL's and Qwen2.5-VL's native-resolution towers, by their --encoder-arch names.
NATIVE_VITS = {
    "qwen2vl": dict(vit_native=True, vit_activation="quick_gelu", vit_norm_eps=1e-6),
    "qwen2.5vl": dict(
        vit_native=True,
        vit_activation="silu",
        vit_norm_eps=1e-6,
        vit_normalization="RMSNorm",
        vit_swiglu=True,
    ),
}
NATIVE_ARCHS = tuple(NATIVE_VITS)  # --encoder-arch values of a native-resolution tower
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
# The benchmark's medium size: compute-bound as GPU kernels at scale are (a backbone layer's
# forward about 11 ms on one core in bf16, measured), the encoder still about 30% of the work.
BENCH_MEDIUM = replace(
    BENCH, vit_hidden=768, vit_heads=12, llm_hidden=768, llm_heads=12, text_len=192
)


def _architecture(cfg: MLLMConfig, part: str) -> dict:
    """TransformerConfig fields that follow the encoder's or backbone's architecture."""
    import torch.nn.functional as F

    if part == "vit":
        from megatron.core.activations import quick_gelu

        act = {"quick_gelu": quick_gelu, "silu": F.silu}.get(cfg.vit_activation, F.gelu)
        return dict(activation_func=act, layernorm_epsilon=cfg.vit_norm_eps)
    if part == "projector":
        return dict(activation_func=F.gelu, add_bias_linear=cfg.projector_bias)
    return dict(
        normalization=cfg.llm_normalization,
        layernorm_epsilon=cfg.llm_norm_eps,
        gated_linear_unit=cfg.llm_swiglu,
        activation_func=F.silu if cfg.llm_swiglu else F.gelu,
        add_bias_linear=cfg.llm_bias,
        add_qkv_bias=cfg.llm_qkv_bias,
        num_query_groups=cfg.llm_query_groups,
    )


def transformer_config(cfg: MLLMConfig, part: str, tp: int, pp: int, **overrides):
    """A megatron-core TransformerConfig for the encoder ("vit"), the projector ("projector")
    or the backbone ("llm")."""
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
        hidden_dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        batch_p2p_comm=False,  # gloo matches p2p in posting order; see MEGATRON_CORE_ON_CPU.md
        batch_p2p_sync=False,
        perform_initialization=True,
        **_architecture(cfg, part),
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)
