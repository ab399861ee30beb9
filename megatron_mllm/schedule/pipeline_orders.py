"""Backbone pipeline orders (1F1B and Megatron's interleaved 1F1B) and their action lists."""

from __future__ import annotations

from megatron_mllm.errors import ConfigError
from megatron_mllm.schedule.actions import Action, B, F
from megatron_mllm.schedule.schedule import ScheduleMeta

# One entry of a backbone order: ("F" | "B", virtual chunk, micro-batch).
Step = tuple[str, int, int]


def one_f_one_b(pp: int, rank: int, num_microbatches: int, extra_warmup: int = 0) -> list[Step]:
    """Non-interleaved 1F1B for one rank: warm-up forwards, steady F/B pairs, cool-down."""
    warmup = min(pp - rank - 1 + extra_warmup, num_microbatches)
    order: list[Step] = [("F", 0, m) for m in range(warmup)]
    for i in range(num_microbatches - warmup):
        order += [("F", 0, warmup + i), ("B", 0, i)]
    order += [("B", 0, m) for m in range(num_microbatches - warmup, num_microbatches)]
    return order


def interleaved_one_f_one_b(pp: int, vpp: int, rank: int, num_microbatches: int) -> list[Step]:
    """Megatron's interleaved 1F1B for one rank (micro-batches in groups of PP)."""
    if num_microbatches % pp:
        raise ConfigError(
            f"interleaved 1F1B needs the micro-batch count ({num_microbatches}) divisible by "
            f"PP ({pp}); change the global batch or micro-batch size"
        )
    total = num_microbatches * vpp
    warmup = min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)

    def which(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k // pp) % vpp
        if not forward:
            chunk = vpp - 1 - chunk
        return chunk, (k // (pp * vpp)) * pp + k % pp

    order: list[Step] = [("F", *which(k, True)) for k in range(warmup)]
    for i in range(total - warmup):
        order += [("F", *which(warmup + i, True)), ("B", *which(i, False))]
    order += [("B", *which(k, False)) for k in range(total - warmup, total)]
    return order


def backbone_orders(meta: ScheduleMeta, extra_warmup: int = 0) -> list[list[Step]]:
    """The order of every rank: interleaved when VPP > 1."""
    if meta.vpp > 1:
        return [
            interleaved_one_f_one_b(meta.pp, meta.vpp, r, meta.num_microbatches)
            for r in range(meta.pp)
        ]
    return [one_f_one_b(meta.pp, r, meta.num_microbatches, extra_warmup) for r in range(meta.pp)]


def backbone_actions(rank: int, order: list[Step]) -> list[Action]:
    """The F/B actions of one rank's order (transfers are added by `transfers.add_transfers`)."""
    return [(F if kind == "F" else B)(rank, mb, chunk) for kind, chunk, mb in order]
