"""What the executor runs of an encoder stage: its work as a list of units, one at a time
(`stages.EncoderStage`, `qwen2_vision.Qwen2VisionStage`)."""

from __future__ import annotations

import torch


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
