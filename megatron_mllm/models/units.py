"""What the executor runs of an encoder stage: its work as a list of units, one at a time
(`stages.EncoderStage`, `qwen2_vision.Qwen2VisionStage`)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def _none() -> None:
    return None


def layer_kernels(
    layer, mask: Callable[[], object] = _none, rotary: Callable[[], object] = _none
) -> list[Callable]:
    """One megatron-core TransformerLayer (local spec) as its eight kernels (the schedule
    core's FORWARD_KERNELS), each a function of a state tuple. `mask` and `rotary` give the
    attention mask and rotary angles when a kernel runs (the micro-batch's, set by the stage);
    a gated MLP's act kernel applies the gate (megatron-core's glu)."""
    attn, mlp, cfg = layer.self_attention, layer.mlp, layer.config

    def bda(kind):
        return getattr(layer, kind)(layer.training, cfg.bias_dropout_fusion)

    def ln1(st):
        return st[0], layer.input_layernorm(st[0])

    def qkv(st):
        q, k, v = attn.get_query_key_value_tensors(st[1], None)
        angles = rotary()
        if angles is not None:  # as SelfAttention.forward applies them, unfused
            from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

            cp = attn.pg_collection.cp
            q = apply_rotary_pos_emb(q, angles, config=attn.config, cp_group=cp)
            k = apply_rotary_pos_emb(k, angles, config=attn.config, cp_group=cp)
        return st[0], q, k, v

    def core(st):
        return st[0], attn.core_attention(st[1], st[2], st[3], mask(), attn.attn_mask_type)

    def proj(st):
        return (bda("self_attn_bda")(attn.linear_proj(st[1]), st[0], layer.hidden_dropout),)

    def ln2(st):
        return st[0], layer.pre_mlp_layernorm(st[0])

    def fc1(st):
        y, bias = mlp.linear_fc1(st[1])
        return st[0], (y + bias if bias is not None else y)

    def act(st):
        if cfg.gated_linear_unit:
            gate, up = torch.chunk(st[1], 2, dim=-1)
            return st[0], mlp.activation_func(gate) * up
        return st[0], mlp.activation_func(st[1])

    def fc2(st):
        return (bda("mlp_bda")(mlp.linear_fc2(st[1]), st[0], layer.hidden_dropout),)

    return [ln1, qkv, core, proj, ln2, fc1, act, fc2]


class UnitStage:
    """An encoder stage whose work is a list of units (`_unit_table()`: (schedule-core name,
    function of a state tuple, parameters) each), run one at a time by the executor."""

    @property
    def num_units(self) -> int:
        return len(self._unit_table())

    def unit_names(self) -> list[str]:
        """The schedule core's name of each unit (its measured-times key)."""
        return [name for name, _, _ in self._unit_table()]

    def run_unit(self, u: int, state: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Unit u on a state; returns the next state."""
        return self._unit_table()[u][1](state)

    def unit_trainable(self, u: int) -> bool:
        """Whether unit u has parameters that train (else it runs without an autograd graph)."""
        return any(p.requires_grad for p in self._unit_table()[u][2])

    def freeze(self) -> None:
        """A frozen encoder: every parameter but the projector's stops training."""
        for name, p in self.named_parameters():
            p.requires_grad_(name.startswith("projector."))
