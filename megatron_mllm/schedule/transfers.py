"""Insert the SEND/RECV pairs a schedule needs: each tensor made on one rank, used on another."""

from __future__ import annotations

from megatron_mllm.schedule.actions import RECV, SEND, Action
from megatron_mllm.schedule.dataflow import Dataflow
from megatron_mllm.schedule.keys import TensorKey
from megatron_mllm.schedule.schedule import Schedule, ScheduleMeta
from megatron_mllm.schedule.validator import backbone_groups


def add_transfers(meta: ScheduleMeta, ranks: list[list[Action]]) -> Schedule:
    """A schedule from compute/DP-only lists: RECV right before each consumer (before its
    TP-bubble group), SEND right after each producer (after its group)."""
    bare = Schedule(meta, ranks)
    flow = Dataflow(meta, bare.encoder_assignment())

    def crossing(keys: list[str], rank: int, incoming: bool) -> list[str]:
        out = []
        for k in keys:
            key = TensorKey.try_parse(k)
            if key is None or not key.is_transfer:
                continue
            producer, consumer = flow.transfer_ranks(k)
            if producer != consumer and (consumer if incoming else producer) == rank:
                out.append(k)
        return out

    result = []
    for r, acts in enumerate(ranks):
        out: list[Action] = []
        for group in backbone_groups(acts):
            members = [acts[i] for i in group]
            made_here = {k for a in members for k in flow.makes(a)}
            recvs = [
                k for a in members for k in crossing(flow.needs(a), r, True) if k not in made_here
            ]
            sends = [k for a in members for k in crossing(flow.makes(a), r, False)]
            out += [RECV(k) for k in dict.fromkeys(recvs)] + members
            out += [SEND(k) for k in dict.fromkeys(sends)]
        result.append(out)
    return Schedule(meta, result)
