"""Parallel plans for the backbone and the encoder, and the rules for colocating them."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_mllm.errors import ConfigError


@dataclass(frozen=True)
class ParallelPlan:
    """Sizes of one model's data, tensor and pipeline parallelism (and virtual pipeline).

    `reversed_stages`, for an encoder plan only: its stages sit on the backbone's stages last
    first (encoder stage 0 on the last backbone stage, its output on backbone stage 0, where
    the backbone reads it), so the backbone's warm-up and cool-down bubbles on the later
    stages take the encoder's first forward and last backward."""

    dp: int
    tp: int
    pp: int
    vpp: int = 1
    reversed_stages: bool = False

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def stage_block(self, stage: int) -> int:
        """Which of its row's PP_e blocks of backbone stages encoder stage `stage` sits in (and,
        the map being its own inverse, which encoder stage sits in block `stage`)."""
        return self.pp - 1 - stage if self.reversed_stages else stage

    def __str__(self) -> str:
        vpp = f" VPP{self.vpp}" if self.vpp > 1 else ""
        order = " reversed" if self.reversed_stages else ""
        return f"DP{self.dp} TP{self.tp} PP{self.pp}{vpp}{order}"


def backbone_plan(world_size: int, tp: int, pp: int, vpp: int = 1) -> ParallelPlan:
    """The backbone plan for `world_size` GPUs; DP is what TP x PP leaves."""
    for name, value in (
        ("tensor parallel size", tp),
        ("pipeline parallel size", pp),
        ("virtual pipeline size", vpp),
        ("GPU count", world_size),
    ):
        if value < 1:
            raise ConfigError(f"{name} is {value}; it must be a positive integer")
    if world_size % (tp * pp):
        raise ConfigError(
            f"{world_size} GPUs cannot be split into TP{tp} x PP{pp} groups; "
            f"use a GPU count divisible by {tp * pp}"
        )
    if vpp > 1 and pp == 1:
        raise ConfigError(f"virtual pipeline size {vpp} needs a pipeline parallel size > 1")
    return ParallelPlan(dp=world_size // (tp * pp), tp=tp, pp=pp, vpp=vpp)


def check_colocated(backbone: ParallelPlan, encoder: ParallelPlan) -> None:
    """Raise ConfigError unless `encoder` can share the backbone's ranks (DESIGN 2.1)."""
    if encoder.world_size != backbone.world_size:
        raise ConfigError(
            f"encoder plan {encoder} covers {encoder.world_size} GPUs but the backbone plan "
            f"{backbone} covers {backbone.world_size}; DP_e x TP_e x PP_e must equal DP x TP x PP"
        )
    if backbone.tp % encoder.tp:
        raise ConfigError(
            f"encoder TP {encoder.tp} does not divide backbone TP {backbone.tp}; "
            f"use a divisor of {backbone.tp}"
        )
    if backbone.pp % encoder.pp:
        raise ConfigError(
            f"encoder PP {encoder.pp} does not divide backbone PP {backbone.pp}; "
            f"use a divisor of {backbone.pp}"
        )


def colocated_encoder_plan(backbone: ParallelPlan, tp: int, pp: int) -> ParallelPlan:
    """The encoder plan with TP_e = `tp`, PP_e = `pp` on the backbone's ranks (DP_e fills in)."""
    if tp < 1 or pp < 1:
        raise ConfigError(f"encoder TP {tp} and PP {pp} must be positive integers")
    if backbone.tp % tp:
        raise ConfigError(
            f"encoder TP {tp} does not divide backbone TP {backbone.tp}; "
            f"use a divisor of {backbone.tp}"
        )
    if backbone.pp % pp:
        raise ConfigError(
            f"encoder PP {pp} does not divide backbone PP {backbone.pp}; "
            f"use a divisor of {backbone.pp}"
        )
    return ParallelPlan(dp=backbone.world_size // (tp * pp), tp=tp, pp=pp)


def encoder_stage_placement(
    backbone: ParallelPlan, encoder: ParallelPlan
) -> tuple[tuple[tuple[int, int], ...], ...]:
    """[pipe][stage] -> (backbone stage, slot) of every encoder pipeline within one backbone
    replica: pipeline p = r * g + k (row r of R = PP/PP_e, slot k of g = TP/TP_e) puts its
    stage j on backbone stage j * R + r, slot k; with `encoder.reversed_stages` stage j sits
    where stage PP_e - 1 - j would."""
    check_colocated(backbone, encoder)
    rows, slots = backbone.pp // encoder.pp, backbone.tp // encoder.tp
    return tuple(
        tuple((encoder.stage_block(j) * rows + p // slots, p % slots) for j in range(encoder.pp))
        for p in range(rows * slots)
    )


def encoder_pipelines_per_backbone_pipeline(backbone: ParallelPlan, encoder: ParallelPlan) -> int:
    """m = DP_e / DP: how many encoder pipelines feed one backbone pipeline."""
    check_colocated(backbone, encoder)
    return encoder.dp // backbone.dp


def enumerate_encoder_plans(backbone: ParallelPlan, encoder_layers: int) -> list[ParallelPlan]:
    """Every colocated encoder plan: TP_e | TP, PP_e | PP, PP_e <= encoder layers; with
    PP_e > 1 both stage orders (see `ParallelPlan.reversed_stages`)."""
    plans = []
    for tp_e in range(1, backbone.tp + 1):
        if backbone.tp % tp_e:
            continue
        for pp_e in range(1, backbone.pp + 1):
            if backbone.pp % pp_e or pp_e > encoder_layers:
                continue
            dp_e = backbone.world_size // (tp_e * pp_e)
            plans.append(ParallelPlan(dp=dp_e, tp=tp_e, pp=pp_e))
            if pp_e > 1:
                plans.append(ParallelPlan(dp=dp_e, tp=tp_e, pp=pp_e, reversed_stages=True))
    return plans
