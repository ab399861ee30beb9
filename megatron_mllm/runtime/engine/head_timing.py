"""The LM head timed apart from the layers on the last backbone stage.

A backbone action's per-layer time is its span over its layers; on the last stage that span
also holds the head (final norm, output layer, loss), which the cost model prices as a block
of its own. Timed apart, the head is the job's own "head" / "head_b" unit (as the start-up
profile times it) and the last stage's layers are layers only: a plan predicted from the job's
times counts the head once, at what it costs here.

Forward: from the final norm's input to the loss. Backward: from the loss's backward to the
gradient at the final norm's input (a split backbone backward leaves the output layer's
weight gradient to its W, counted with the layers'). Marks are the step clock's, so on a GPU
they are events on the stream the work runs on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch


class HeadTimer:
    """Marks of the head's forward and backward on one stage's last chunk, action by action."""

    def __init__(self, chunk, mark: Callable[[], object], backward: bool) -> None:
        gpt = chunk.gpt
        norm = getattr(gpt.decoder, "final_layernorm", None)
        self.module: torch.nn.Module = norm if norm is not None else gpt.output_layer
        self.mark, self.hooks_backward = mark, backward
        self.opened = self.closed = None
        self.spans: list[tuple[str, object, object, bool]] = []  # direction, start, end, timed

    def attach(self) -> list:
        """The hooks, registered (remove them after the step)."""
        hooks = [self.module.register_forward_pre_hook(self._open)]
        if self.hooks_backward:
            hooks.append(self.module.register_full_backward_hook(self._close))
        return hooks

    def forward_done(self, timed: bool = True) -> None:
        """After the loss: the head's forward ends here (`timed`: a sample of its unit; a pool
        micro-batch's, with no loss, is only cut from the layers')."""
        if self.opened is not None:
            self.spans.append(("forward", self.opened, self.mark(), timed))
            self.opened = None

    @contextlib.contextmanager
    def backward(self):
        """Around the loss's backward: the head's part of it, from its start to the gradient
        at the norm's input (if it got there)."""
        self.closed, start = None, self.mark()
        yield
        if self.closed is not None:
            self.spans.append(("backward", start, self.closed, True))

    def take(self) -> list[tuple[str, object, object, bool]]:
        """The spans since the last call."""
        out, self.spans = self.spans, []
        return out

    def _open(self, module, args) -> None:
        self.opened = self.mark()

    def _close(self, module, grad_input, grad_output) -> None:
        self.closed = self.mark()
