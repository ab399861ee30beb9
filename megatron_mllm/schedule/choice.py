"""Which schedule a run trains with, as one typed value from --bubble-schedule to the log line."""

from __future__ import annotations

from enum import StrEnum


class ScheduleChoice(StrEnum):
    """--bubble-schedule's values. `planned` is the static schedule the planner builds for it;
    `per_step` says whether each step is planned again for its own data (optimus-adaptive)."""

    MEGATRON = "megatron"  # encoder on stage 0, 1F1B, Megatron's even layer split
    BALANCED = "balanced"  # the same with fewer backbone layers on stage 0
    OPTIMUS = "optimus"  # the encoder in the backbone's bubbles
    OPTIMUS_ADAPTIVE = "optimus-adaptive"  # optimus, each step planned for its own images

    @property
    def planned(self) -> str:
        """The static schedule's name: megatron, balanced or optimus."""
        return "optimus" if self is ScheduleChoice.OPTIMUS_ADAPTIVE else self.value

    @property
    def per_step(self) -> bool:
        return self is ScheduleChoice.OPTIMUS_ADAPTIVE

    @property
    def is_optimus(self) -> bool:
        return self.planned == "optimus"
