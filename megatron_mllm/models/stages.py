"""Pipeline stages of the MLLM, built from megatron-core parts.

* `EncoderStage`: one encoder pipeline stage: patch embedding (first stage), megatron-core
  TransformerLayers with bidirectional attention, final norm and megatron-core's
  MultimodalProjector (last stage). Its work is a list of *units* (patch embedding, each layer,
  norm + projector) that can run one at a time: the schedule's encoder "kernels" at layer size.
* `BackboneStage`: a megatron-core GPTModel stage; stage 0 takes the image embeddings followed by
  the text embeddings as its decoder input.

Tensors are sequence-first ([s, b, h]) like megatron-core. The same code builds a one-process
model (TP = PP = 1) and any shard of it.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from megatron_mllm.models.config import MLLMConfig, transformer_config
from megatron_mllm.models.loss import vocab_parallel_cross_entropy


def _vit_layer_spec():
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.transformer.enums import AttnMaskType

    spec = copy.deepcopy(get_vit_layer_with_local_spec())
    spec.submodules.self_attention.params["attn_mask_type"] = AttnMaskType.no_mask
    return spec


class EncoderStage(nn.Module):
    """Encoder stage `stage` of `num_stages` (layers split evenly) on TP group `pg.tp`."""

    def __init__(self, cfg: MLLMConfig, stage: int, num_stages: int, pg, tp: int) -> None:
        super().__init__()
        from megatron.core.models.vision.multimodal_projector import MultimodalProjector
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer.mlp import MLPSubmodules
        from megatron.core.transformer.transformer_block import TransformerBlock

        self.cfg, self.stage, self.num_stages = cfg, stage, num_stages
        self.first, self.last = stage == 0, stage == num_stages - 1
        config = transformer_config(cfg, "vit", tp, num_stages)
        if self.first:
            self.patch_embed = nn.Linear(cfg.patch_dim, cfg.vit_hidden, bias=cfg.vit_patch_bias)
            self.pos_embed = nn.Parameter(
                torch.randn(cfg.encoder_seq_len, 1, cfg.vit_hidden) * 0.02
            )
            if cfg.vit_class_token:
                self.class_embedding = nn.Parameter(torch.randn(cfg.vit_hidden) * 0.02)
            if cfg.vit_pre_norm:
                self.pre_layernorm = nn.LayerNorm(cfg.vit_hidden, eps=cfg.vit_norm_eps)
        self.block = TransformerBlock(
            config,
            _vit_layer_spec(),
            post_layer_norm=self.last and cfg.vit_final_norm,
            pre_process=self.first,
            post_process=self.last,
            pg_collection=pg,
        )
        if self.last:
            proj_config = transformer_config(
                cfg, "projector", tp, 1, num_layers=1, ffn_hidden_size=cfg.llm_hidden
            )
            self.projector = MultimodalProjector(
                proj_config,
                MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                "mlp",
                cfg.vit_hidden,
                tp_group=pg.tp,
            )

    # -- units -------------------------------------------------------------------------------
    @property
    def num_units(self) -> int:
        return int(self.first) + len(self.block.layers) + int(self.last)

    def run_unit(self, u: int, x: torch.Tensor) -> torch.Tensor:
        """Unit u: [patch embedding], layers..., [final norm + projector]."""
        if self.first:
            if u == 0:
                return self.embed(x)
            u -= 1
        if u < len(self.block.layers):
            out = self.block.layers[u](hidden_states=x, attention_mask=None)
            return out[0] if isinstance(out, tuple) else out
        if self.cfg.vit_class_token:
            x = x[1:]  # LLaVA's "default" feature selection: patches only
        if self.block.final_layernorm is not None:
            x = self.block.final_layernorm(x)
        out = self.projector(x)
        return out[0] if isinstance(out, tuple) else out

    def freeze(self) -> None:
        """A frozen encoder: every parameter but the projector's stops training."""
        for name, p in self.named_parameters():
            p.requires_grad_(name.startswith("projector."))

    def unit_trainable(self, u: int) -> bool:
        """Whether unit u has parameters that train (else it runs without an autograd graph)."""
        if self.first:
            if u == 0:
                return any(
                    p.requires_grad
                    for n, p in self.named_parameters()
                    if not n.startswith(("block.", "projector."))
                )
            u -= 1
        if u < len(self.block.layers):
            return any(p.requires_grad for p in self.block.layers[u].parameters())
        tail = [*self.projector.parameters()]
        if self.block.final_layernorm is not None:
            tail += [*self.block.final_layernorm.parameters()]
        return any(p.requires_grad for p in tail)

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """[b, c, H, W] images -> [encoder tokens, b, vit_hidden]."""
        p = self.cfg.patch_size
        b = images.shape[0]
        patches = images.unfold(2, p, p).unfold(3, p, p)  # b, c, gh, gw, p, p
        patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(b, self.cfg.num_patches, -1)
        x = self.patch_embed(patches).transpose(0, 1)
        if self.cfg.vit_class_token:
            x = torch.cat([self.class_embedding.expand(1, b, -1), x], dim=0)
        x = x + self.pos_embed
        return self.pre_layernorm(x) if self.cfg.vit_pre_norm else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for u in range(self.num_units):
            x = self.run_unit(u, x)
        return x


def causal_mask(seq_len: int) -> torch.Tensor:
    """megatron-core's boolean mask convention: True where attention is not allowed."""
    return torch.triu(torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool), diagonal=1)


class BackboneStage(nn.Module):
    """A GPTModel pipeline stage (`pg.pp` decides which layers it holds)."""

    def __init__(
        self,
        cfg: MLLMConfig,
        pre_process: bool,
        post_process: bool,
        pg,
        tp: int,
        pp: int,
        vp_stage: int | None = None,
        **config_overrides,
    ) -> None:
        super().__init__()
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel

        assert cfg.llm_normalization in ("LayerNorm", "RMSNorm")

        self.cfg, self.pg = cfg, pg
        self.pre_process, self.post_process = pre_process, post_process
        config = transformer_config(cfg, "llm", tp, pp, **config_overrides)
        self.gpt = GPTModel(
            config,
            get_gpt_layer_local_spec(normalization=cfg.llm_normalization),
            cfg.vocab_size,
            cfg.seq_len,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=False,
            position_embedding_type="rope",
            rotary_base=int(cfg.rope_base),
            pg_collection=pg,
            vp_stage=vp_stage,
        )
        self.register_buffer("mask", causal_mask(cfg.seq_len), persistent=False)

    def set_input_tensor(self, tensor) -> None:
        self.gpt.set_input_tensor(tensor)

    def decoder_input(self, image_embeds: list[torch.Tensor], text: torch.Tensor) -> torch.Tensor:
        """Stage 0: [image tokens of every encoder; text tokens] as [s, b, h]."""
        positions = torch.arange(text.shape[1]).unsqueeze(0).expand_as(text)
        words = self.gpt.embedding(input_ids=text, position_ids=positions)
        return torch.cat([*image_embeds, words], dim=0)

    def forward(self, hidden: torch.Tensor | None, decoder_input: torch.Tensor | None = None):
        """Non-first stages pass `hidden`; stage 0 passes `decoder_input`."""
        if not self.pre_process:
            self.gpt.set_input_tensor(hidden)
        return self.gpt(
            input_ids=None, position_ids=None, attention_mask=self.mask, decoder_input=decoder_input
        )

    def loss(self, logits: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """Mean next-token loss over the text tokens; `logits` is [b, s, vocab/tp]."""
        n = self.cfg.num_patches
        pred = logits[:, n - 1 : n - 1 + text.shape[1]]
        return vocab_parallel_cross_entropy(pred, text, self.pg.tp).mean()
