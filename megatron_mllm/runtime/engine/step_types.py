"""What one pass of the executor is asked to do (`PassOptions`) and what it returns
(`StepResult`): losses, trace spans, measured unit times and the counters tests read."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import torch

from megatron_mllm.schedule.simulator import Span

# Dynamic mode: encoder micro-batches whose work may run ahead of its place in the program (the
# planner assumes no more than this many encoder micro-batches in flight beyond its schedule).
MAX_ENCODER_AHEAD = 2


@dataclass
class StepResult:
    losses: dict[int, float] = field(default_factory=dict)  # micro-batch -> loss (last stage)
    # Evaluation: micro-batch -> (samples whose every answer token is the argmax, samples with
    # an answer): teacher-forced exact match, which is greedy decoding's exact match.
    matches: dict[int, tuple[int, int]] = field(default_factory=dict)
    spans: list[Span] = field(default_factory=list)
    seconds: float = 0.0
    moved: int = 0  # dynamic mode: encoder chunks run ahead of their place in the program
    overlapped: int = 0  # fills run while a backbone TP collective was in flight
    overlapped_in: dict[str, int] = field(default_factory=dict)  # ... per collective kind
    # Measured seconds for re-planning: (model, "forward"|"backward", unit name) -> samples;
    # the backbone's per layer (a chunk's F or B compute time over its layer count) and per TP
    # collective: ("llm", "collectives", "all_reduce" | "all_gather" | "reduce_scatter" [+ "_b"]).
    unit_times: dict[tuple[str, str, str], list[float]] = field(default_factory=dict)
    # Sender -> the most of its receives posted and not yet consumed at once (read when one of
    # its receives is taken).
    max_posted_ahead: dict[int, int] = field(default_factory=dict)
    max_encoder_ahead: int = 0  # dynamic mode: most encoder micro-batches run ahead at once
    # Most encoder (stage, micro-batch) activations held at once, and the plan's own peak (the
    # schedule the planner costed memory for): dynamic mode never holds more than the plan.
    max_encoder_live: int = 0
    planned_encoder_live: int = 0
    leftover_keys: list[str] = field(default_factory=list)  # the tensor table at step end
    fills_per_wait: list[int] = field(default_factory=list)  # fills run inside each TP wait
    deferred_products: int = 0  # split backwards: weight products a W or EW action computed


class PassKind(Enum):
    """What a pass of a program is for."""

    TRAIN = "train"  # forward and backward; losses for the step
    EVAL = "eval"  # forward only, no graph: losses and exact-match counts (validation)
    POOL = "pool"  # forward only, no graph: a coreset pool's output-layer inputs


@dataclass(frozen=True)
class PassOptions:
    """How one pass of a program runs; the defaults are a training step with tagged messages.
    `kind`: a training step, an evaluation or a coreset pool's pass;
    `ordered`: NCCL's order-matched messages (receive orders, a group per direction);
    `dynamic`: ready encoder work while a message is on its way; `overlap_fills`: TP-bubble
    fills inside the backbone's TP collectives; `loss_scale` / `loss_norm`: the backward's
    scale and the loss's normaliser; `after_program`: run on the executor after the program."""

    timeout_s: float = 60.0
    kind: PassKind = PassKind.TRAIN
    dynamic: bool = False
    ordered: tuple[dict, dict] | None = None
    overlap_fills: bool = False
    recv_lookahead: int | None = None  # None: the message mode's default (messages.py)
    max_encoder_ahead: int = MAX_ENCODER_AHEAD
    loss_scale: torch.Tensor | None = None
    loss_norm: torch.Tensor | None = None
    after_program: Callable | None = None
