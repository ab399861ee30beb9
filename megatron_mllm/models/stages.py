"""Pipeline stages of the MLLM, built from megatron-core parts.

* `EncoderStage`: one encoder pipeline stage: patch embedding (first stage), megatron-core
  TransformerLayers with bidirectional attention, final norm and megatron-core's
  MultimodalProjector (last stage). Its work is a list of *units* (patch embedding, each layer,
  norm + projector) that can run one at a time: the schedule's encoder "kernels" at layer size.
* `BackboneStage`: a megatron-core GPTModel stage; stage 0's decoder input is the text
  embeddings with the image embeddings where the micro-batch's image mask puts them.

Tensors are sequence-first ([s, b, h]) like megatron-core. The same code builds a one-process
model (TP = PP = 1) and any shard of it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from megatron_mllm.data.batch import IGNORE_INDEX, MicroBatch
from megatron_mllm.models.config import MLLMConfig, transformer_config
from megatron_mllm.models.loss import vocab_parallel_cross_entropy
from megatron_mllm.models.units import UnitStage, layer_kernels
from megatron_mllm.schedule.cost_model import FORWARD_KERNELS


def _vit_layer_spec(impl: str = "local"):
    """megatron-core's ViT layer spec (local, or Transformer Engine's), bidirectional."""
    from megatron.core.models.vision import vit_layer_specs
    from megatron.core.transformer.enums import AttnMaskType

    if impl == "transformer_engine":
        spec = copy.deepcopy(vit_layer_specs.get_vit_layer_with_transformer_engine_spec())
    else:
        spec = copy.deepcopy(vit_layer_specs.get_vit_layer_with_local_spec())
    spec.submodules.self_attention.params["attn_mask_type"] = AttnMaskType.no_mask
    return spec


def _layer(layer, x: torch.Tensor) -> torch.Tensor:
    out = layer(hidden_states=x, attention_mask=None)
    return out[0] if isinstance(out, tuple) else out


def _recomputed(layer, x: torch.Tensor) -> torch.Tensor:
    """A layer whose activations are recomputed in backward (megatron-core's checkpoint: RNG
    states restored, so dropout draws the same)."""
    from megatron.core.tensor_parallel import checkpoint

    return checkpoint(lambda h: _layer(layer, h), False, x)


class EncoderStage(UnitStage, nn.Module):
    """Encoder `index`'s stage `stage` of `num_stages` (layers split evenly) on TP group
    `pg.tp`; its work as units of layer or kernel size (`kernel_units`)."""

    def __init__(
        self,
        cfg: MLLMConfig,
        stage: int,
        num_stages: int,
        pg,
        tp: int,
        kernel_units: bool = False,
        index: int = 0,
        recompute_layers: bool = False,
        transformer_impl: str = "local",
        **config_overrides,
    ) -> None:
        super().__init__()
        if transformer_impl != "local" and kernel_units:  # TE fuses ln1 into the QKV GEMM
            raise ValueError("kernel-sized encoder units are cut from megatron-core's local layers")
        if recompute_layers and kernel_units:
            raise ValueError("encoder recomputation works on layer units, not kernel units")
        self.kernel_units, self.index = kernel_units, index
        self.recompute_layers = recompute_layers  # each layer unit keeps only its input
        cfg = cfg.encoder_config(index)
        from megatron.core.models.vision.multimodal_projector import MultimodalProjector
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer.mlp import MLPSubmodules
        from megatron.core.transformer.transformer_block import TransformerBlock

        self.cfg, self.stage, self.num_stages = cfg, stage, num_stages
        self.first, self.last = stage == 0, stage == num_stages - 1
        config = transformer_config(cfg, "vit", tp, num_stages, **config_overrides)
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
            _vit_layer_spec(transformer_impl),
            post_layer_norm=self.last and cfg.vit_final_norm,
            pre_process=self.first,
            post_process=self.last,
            pg_collection=pg,
        )
        if self.last:
            proj_config = transformer_config(
                cfg,
                "projector",
                tp,
                1,
                num_layers=1,
                ffn_hidden_size=cfg.llm_hidden,
                **config_overrides,
            )
            self.projector = MultimodalProjector(
                proj_config,
                MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                "mlp",
                cfg.vit_hidden,
                tp_group=pg.tp,
            )

    # -- units -------------------------------------------------------------------------------
    # A unit maps a state (a tuple of tensors) to the next; a stage's input and output states are
    # one tensor. "layer" units: [patch embedding], each layer, [final norm + projector].
    # "kernel" units (the schedule core's kernels): [embed], per layer ln1, qkv, attn, proj (+
    # bias-dropout-add), ln2, fc1, act, fc2 (+ bias-dropout-add), then [proj_fc1 (final norm, fc1,
    # activation), proj_fc2]. Residual streams ride along in the state, so the executor can stop
    # between any two units and run each backward on its own.
    def _unit_table(self) -> list[tuple[str, Callable, list[torch.Tensor]]]:
        """(schedule-core name, function, parameters) of each unit, built once."""
        if getattr(self, "_units", None) is not None:
            return self._units
        units = []
        if self.first:
            own = [p for n, p in self.named_parameters() if not n.startswith(("block.", "proj"))]
            units.append(("embed", lambda st: (self.embed(st[0]),), own))
        for layer in self.block.layers:
            params = [*layer.parameters()]
            if self.recompute_layers:
                units.append(("layer", lambda st, lay=layer: (_recomputed(lay, st[0]),), params))
            elif not self.kernel_units:
                units.append(("layer", lambda st, layer=layer: (_layer(layer, st[0]),), params))
            else:
                kernels = layer_kernels(layer)
                units += [(n, fn, params) for n, fn in zip(FORWARD_KERNELS, kernels, strict=True)]
        if self.last:
            tail = [*self.projector.parameters()]
            if self.block.final_layernorm is not None:
                tail += [*self.block.final_layernorm.parameters()]
            if not self.kernel_units:
                whole = lambda st: (self._projector_fc2(self._projector_fc1(st[0])),)  # noqa: E731
                units.append(("projector", whole, tail))
            else:
                units.append(("proj_fc1", lambda st: (self._projector_fc1(st[0]),), tail))
                units.append(("proj_fc2", lambda st: (self._projector_fc2(st[0]),), tail))
        self._units = units
        return units

    def _projector_fc1(self, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.vit_class_token:
            x = x[1:]  # LLaVA's "default" feature selection: patches only
        if self.block.final_layernorm is not None:
            x = self.block.final_layernorm(x)
        mlp = self.projector.encoder
        y, bias = mlp.linear_fc1(x)
        return mlp.activation_func(y + bias if bias is not None else y)

    def _projector_fc2(self, x: torch.Tensor) -> torch.Tensor:
        y, bias = self.projector.encoder.linear_fc2(x)
        return y + bias if bias is not None else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:  # a micro-batch without images: nothing to compute
            cfg, n = self.cfg, x.shape[0] if self.first else x.shape[1]
            if self.last:
                return x.new_zeros(cfg.num_patches, n, cfg.llm_hidden)
            return x.new_zeros(cfg.encoder_seq_len, n, cfg.vit_hidden)
        state = (x,)
        for u in range(self.num_units):
            state = self.run_unit(u, state)
        return state[0]

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """[b, c, H, W] images -> [encoder tokens, b, vit_hidden]."""
        p = self.cfg.patch_size
        b = images.shape[0]
        if images.shape[-1] != self.cfg.image_size:  # an encoder with its own resolution
            size = (self.cfg.image_size, self.cfg.image_size)
            images = torch.nn.functional.interpolate(images, size=size, mode="nearest")
        patches = images.unfold(2, p, p).unfold(3, p, p)  # b, c, gh, gw, p, p
        patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(
            b, self.cfg.num_patches, self.cfg.patch_dim
        )
        x = self.patch_embed(patches).transpose(0, 1)
        if self.cfg.vit_class_token:
            x = torch.cat([self.class_embedding.expand(1, b, -1), x], dim=0)
        x = x + self.pos_embed
        return self.pre_layernorm(x) if self.cfg.vit_pre_norm else x


def encode(encoder: nn.Module, batch: MicroBatch) -> torch.Tensor:
    """An encoder stage's output for the micro-batch's images (native-resolution ones with
    their patch grids)."""
    return encoder(batch.images, batch.grids) if batch.native else encoder(batch.images)


def causal_mask(seq_len: int) -> torch.Tensor:
    """megatron-core's boolean mask convention: True where attention is not allowed."""
    return torch.triu(torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool), diagonal=1)


class BackboneStage(nn.Module):
    """A GPTModel pipeline stage (`pg.pp` decides which layers it holds).

    With `sequence_parallel` (TP > 1) the stage's activations are [s/tp, b, h]: megatron-core's
    linear layers all-gather and reduce-scatter them, and stage 0 scatters its decoder input
    after putting the image tokens into the (full, unscattered) text embeddings.
    """

    def __init__(
        self,
        cfg: MLLMConfig,
        pre_process: bool,
        post_process: bool,
        pg,
        tp: int,
        pp: int,
        vp_stage: int | None = None,
        sequence_parallel: bool = False,
        transformer_impl: str = "local",
        **config_overrides,
    ) -> None:
        super().__init__()
        from megatron.core.models.gpt import gpt_layer_specs
        from megatron.core.models.gpt.gpt_model import GPTModel

        assert cfg.llm_normalization in ("LayerNorm", "RMSNorm")

        self.cfg, self.pg = cfg, pg
        self.pre_process, self.post_process = pre_process, post_process
        self.sequence_parallel = sequence_parallel and tp > 1
        config_overrides.setdefault("sequence_parallel", self.sequence_parallel)
        # megatron-core's multimodal rotary embedding: Qwen2-VL's sections, or every section on
        # the one position (the model's 1-D RoPE), with positions per row and token (packed
        # rows restart them).
        half = cfg.llm_hidden // cfg.llm_heads // 2
        config_overrides.setdefault("mrope_section", list(cfg.llm_mrope_section) or [half, 0, 0])
        config = transformer_config(cfg, "llm", tp, pp, **config_overrides)
        self.gpt = GPTModel(
            config,
            gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
                normalization=cfg.llm_normalization
            )
            if transformer_impl == "transformer_engine"
            else gpt_layer_specs.get_gpt_layer_local_spec(normalization=cfg.llm_normalization),
            cfg.vocab_size,
            cfg.seq_len,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=False,
            position_embedding_type="mrope",
            rotary_base=int(cfg.rope_base),
            pg_collection=pg,
            vp_stage=vp_stage,
            scatter_embedding_sequence_parallel=False,  # decoder_input scatters after the concat
        )
        if self.sequence_parallel and pre_process:
            # The text embedding runs as without sequence parallelism (full sequence, dropout from
            # the default RNG, the same on every TP rank); its own config says so.
            self.gpt.embedding.config = copy.copy(config)
            self.gpt.embedding.config.sequence_parallel = False

    def set_input_tensor(self, tensor) -> None:
        self.gpt.set_input_tensor(tensor)

    def decoder_input(self, image_embeds: list[torch.Tensor], batch: MicroBatch) -> torch.Tensor:
        """Stage 0: the text embeddings with each image's tokens (every encoder's, in encoder
        order) where `batch.image_mask` puts them, as [s, b, h] (this TP rank's [s/tp, b, h]
        slice with sequence parallelism)."""
        tokens = batch.tokens
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        words = self.gpt.embedding(input_ids=tokens, position_ids=positions)  # [s, b, h]
        images = torch.cat(image_embeds, dim=0)  # [image tokens, n, h]
        mask = batch.image_mask.t().unsqueeze(-1)  # (its count was checked on the host)
        # Sample-major order: image k's tokens fill the k-th run of masked positions.
        feats = images.transpose(0, 1).reshape(-1, images.shape[-1]).to(words.dtype)
        x = words.transpose(0, 1).masked_scatter(mask.transpose(0, 1), feats)
        x = x.transpose(0, 1).contiguous()  # [s, b, h] laid out as megatron-core sends it
        if not self.sequence_parallel:
            return x
        from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

        return scatter_to_sequence_parallel_region(x, group=self.pg.tp)

    def forward(
        self,
        hidden: torch.Tensor | None,
        decoder_input: torch.Tensor | None = None,
        batch: MicroBatch | None = None,
    ):
        """Non-first stages pass `hidden`; stage 0 passes `decoder_input`. `batch`: the
        micro-batch's positions and attention mask (packed rows: within each sample); without
        it one unpacked sample per row."""
        if not self.pre_process:
            self.gpt.set_input_tensor(hidden)
        if batch is None:
            x = hidden if decoder_input is None else decoder_input
            s = self.cfg.seq_len
            positions = torch.arange(s, device=x.device).expand(x.shape[1], s)
            mask = causal_mask(s).to(x.device)
            if self.cfg.llm_mrope_section:
                raise ValueError("multimodal positions need the micro-batch: pass `batch`")
        else:
            positions, mask = batch.position_ids(), batch.attention_mask()
        if self.cfg.llm_mrope_section and batch.native and batch.num_images:
            from megatron_mllm.models.positions import native_mrope_position_ids

            grids = batch.grids[:, 1:] // batch.merge  # backbone tokens' rows and columns
            position_ids = native_mrope_position_ids(batch.image_mask, positions, grids)
        elif self.cfg.llm_mrope_section:
            from megatron_mllm.models.positions import mrope_position_ids

            grid = self.cfg.image_grid
            position_ids = mrope_position_ids(batch.image_mask, positions, grid)
        else:
            position_ids = positions.unsqueeze(0).expand(3, -1, -1)
        return self.gpt(
            input_ids=None,
            position_ids=position_ids,
            attention_mask=mask,
            decoder_input=decoder_input,
        )

    def loss(self, logits: torch.Tensor, batch: MicroBatch, summed: bool = False) -> torch.Tensor:
        """Mean next-token loss over the labelled positions (`summed`: their sum, Megatron's
        --calculate-per-token-loss, normalised over the global batch by the caller); `logits`
        is [b, s, vocab/tp]."""
        labelled = batch.labels != IGNORE_INDEX  # masked, not indexed: no host sync on a GPU
        target = batch.labels.clamp(min=0)
        per_token = vocab_parallel_cross_entropy(logits.float(), target, self.pg.tp)  # fp32 loss
        total = (per_token * labelled).sum()
        return total if summed else total / labelled.sum().clamp(min=1)

    @torch.no_grad()
    def exact_matches(self, logits: torch.Tensor, batch: MicroBatch) -> torch.Tensor:
        """[samples whose every labelled token is the (vocabulary-parallel) argmax, samples
        with a labelled token]: greedy decoding's exact match, teacher-forced."""
        import torch.distributed as dist

        labelled = batch.labels != IGNORE_INDEX
        part = logits.shape[-1]
        start = dist.get_rank(self.pg.tp) * part if dist.get_world_size(self.pg.tp) > 1 else 0
        logits = logits.float()
        best = logits.max(dim=-1).values
        local = batch.labels - start
        here = labelled & (local >= 0) & (local < part)
        target = logits.gather(-1, local.clamp(0, part - 1).unsqueeze(-1)).squeeze(-1)
        target = torch.where(here, target, torch.zeros_like(target))
        if dist.get_world_size(self.pg.tp) > 1:
            dist.all_reduce(best, op=dist.ReduceOp.MAX, group=self.pg.tp)
            dist.all_reduce(target, group=self.pg.tp)
        right = (target >= best) | ~labelled
        answered = labelled.any(dim=1)
        return torch.stack([(right.all(dim=1) & answered).sum(), answered.sum()])
