"""Insert the SEND/RECV pairs a schedule needs: each tensor made on one rank, used on another."""

from __future__ import annotations

from megatron_mllm.schedule.actions import RECV, SEND, Action
from megatron_mllm.schedule.dataflow import dataflow_of
from megatron_mllm.schedule.schedule import Schedule, ScheduleMeta
from megatron_mllm.schedule.validator import backbone_groups


def add_transfers(meta: ScheduleMeta, ranks: list[list[Action]]) -> Schedule:
    """A schedule from compute/DP-only lists: RECV right before each consumer (before its
    TP-bubble group), SEND right after each producer (after its group)."""
    flow = dataflow_of(meta, Schedule(meta, ranks).encoder_assignment())
    result = []
    for r, acts in enumerate(ranks):
        out: list[Action] = []
        for group in backbone_groups(acts):
            members = tuple(acts[i] for i in group)
            recvs, sends = flow.group_transfers(r, members)
            out += [RECV(k) for k in recvs]
            out += members
            out += [SEND(k) for k in sends]
        result.append(out)
    return Schedule(meta, result)
