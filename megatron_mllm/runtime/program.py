"""From a schedule rank's list to one GPU's program: its own encoder slot's actions, and every
SEND/RECV turned into GPU-to-GPU messages (also inside a rank, where the encoder's output moves
from its slot's GPUs to the whole TP group)."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from megatron_mllm.parallel.groups import ColocatedGroups, backbone_rank
from megatron_mllm.schedule.actions import Action
from megatron_mllm.schedule.dataflow import Dataflow, key_prefix
from megatron_mllm.schedule.schedule import Schedule
from megatron_mllm.schedule.validator import backbone_groups


@dataclass(frozen=True)
class Op:
    """One step of a GPU's program: an IR action (compute, AG, RS) or a message."""

    kind: str  # "run", "send", "recv"
    action: Action | None = None
    key: str = ""
    peer: int = -1
    fills: tuple[Action, ...] = ()  # TP-bubble fills that travel with a backbone action

    @property
    def tag(self) -> int:
        return zlib.crc32(self.key.encode()) & 0x7FFFFFF

    def __str__(self) -> str:
        if self.kind == "run":
            return str(self.action)
        arrow = "->" if self.kind == "send" else "<-"
        return f"{self.kind.upper()}:{self.key}{arrow}rank{self.peer}"


class Routes:
    """Which GPU sends each key to which GPU, inside one backbone replica."""

    def __init__(self, schedule: Schedule, groups: ColocatedGroups, encoder_tp: int) -> None:
        self.meta = schedule.meta
        self.flow = Dataflow(schedule.meta, schedule.encoder_assignment())
        self.bplan = groups.backbone_plan
        self.dp = groups.coords.dp
        self.enc_tp = encoder_tp

    def _rank(self, tp: int, stage: int) -> int:
        return backbone_rank(self.bplan, tp, self.dp, stage)

    def pairs(self, key: str) -> list[tuple[int, int]]:
        prefix = key_prefix(key)
        src_lane, dst_lane = self.flow.transfer_ranks(key)
        tp = self.bplan.tp
        if prefix in ("act", "grad"):
            return [(self._rank(t, src_lane), self._rank(t, dst_lane)) for t in range(tp)]
        e, m = int(key.split(".")[1][1:]), int(key.split(".")[-1][1:])
        enc = self.meta.encoders[e]
        pipe = self.flow.assignment[e][m]
        if prefix == "eout":
            slot = enc.placement[pipe][-1][1]
            return [
                (
                    self._rank(slot * self.enc_tp + t % self.enc_tp, src_lane),
                    self._rank(t, dst_lane),
                )
                for t in range(tp)
            ]
        slot = enc.placement[pipe][0][1]
        return [
            (
                self._rank(slot * self.enc_tp + t, src_lane),
                self._rank(slot * self.enc_tp + t, dst_lane),
            )
            for t in range(self.enc_tp)
        ]


def gpu_program(schedule: Schedule, groups: ColocatedGroups, encoder_tp: int) -> list[Op]:
    """This GPU's ordered ops (see module docstring)."""
    me = groups.coords.rank
    lane, slot = groups.coords.stage, groups.coords.enc_slot
    routes = Routes(schedule, groups, encoder_tp)
    flow = routes.flow
    acts = schedule.ranks[lane]
    ops: list[Op] = []

    def mine(a: Action) -> bool:
        return a.kind not in ("EF", "EB") or flow.slot(a) == slot

    def messages(key: str, incoming: bool) -> list[Op]:
        """This GPU's receives (or sends) of `key`: one per route that ends (starts) here."""
        return [
            Op("recv", key=key, peer=src) if incoming else Op("send", key=key, peer=dst)
            for src, dst in routes.pairs(key)
            if src != dst and (dst if incoming else src) == me
        ]

    def local_moves(keys: list[str], incoming: bool) -> list[Op]:
        """Encoder output/gradient moving between GPUs of this rank (no SEND/RECV in the IR)."""
        out = []
        for k in keys:
            if key_prefix(k) in ("eout", "egrad") and len(set(flow.transfer_ranks(k))) == 1:
                out += messages(k, incoming)
        return out

    for group in backbone_groups(acts):
        members = [acts[i] for i in group if mine(acts[i])]
        if not members:
            continue
        main = members[-1]
        if main.kind in ("SEND", "RECV"):
            ops += messages(main.key, incoming=main.kind == "RECV")
            continue
        for a in members:
            ops += local_moves(flow.needs(a), incoming=True)
        ops.append(Op("run", main, fills=tuple(members[:-1])))
        for a in members:
            ops += local_moves(flow.makes(a), incoming=False)
    return ops
