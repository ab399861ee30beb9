"""A schedule: per-rank ordered action lists plus the metadata that says what must be in them.

A schedule rank ("lane") is one backbone pipeline stage: the TP group of GPUs holding that stage.
Every data-parallel replica runs the same lists. An encoder pipeline stage sits on one lane in one
"slot": a lane with backbone TP=8 and encoder TP_e=2 has 4 slots, each the TP_e GPUs of one
encoder pipeline; backbone actions occupy every slot, encoder actions only their own.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_mllm.errors import ConfigError
from megatron_mllm.parallel.plans import ParallelPlan
from megatron_mllm.schedule.actions import Action, parse_action


@dataclass(frozen=True)
class EncoderMeta:
    """One encoder's pipelines: kernel counts per stage and where each (pipe, stage) lives."""

    name: str
    fwd_kernels: tuple[int, ...]  # per encoder stage
    bwd_kernels: tuple[int, ...]  # per encoder stage; 0 where nothing runs backward (frozen)
    placement: tuple[tuple[tuple[int, int], ...], ...]  # [pipe][stage] -> (lane, slot)
    # A split backward: weight-gradient kernels per stage (EW actions; EB is then the input
    # gradient only). (): not split.
    wgt_kernels: tuple[int, ...] = ()

    def wgt(self, stage: int) -> int:
        """The stage's weight-gradient kernels (0: its EB does all of its backward)."""
        return self.wgt_kernels[stage] if self.wgt_kernels else 0

    @property
    def num_stages(self) -> int:
        return len(self.fwd_kernels)

    @property
    def num_pipes(self) -> int:
        return len(self.placement)

    @property
    def trainable(self) -> bool:
        return any(self.bwd_kernels)


@dataclass(frozen=True)
class ScheduleMeta:
    """What a schedule must contain: pipeline shape, micro-batches and encoder pipelines."""

    pp: int
    vpp: int
    num_microbatches: int
    slots: int = 1
    encoders: tuple[EncoderMeta, ...] = ()
    name: str = ""
    backbone_layers: tuple[int, ...] = ()  # layers per virtual stage (the executor builds these)
    # Where the encoders run (all share one plan): the encoder plan as (DP, TP, PP), and whether
    # they sit whole in backbone stage 0's pre-process (Megatron's placement). () in schedules
    # saved before these fields existed: the runtime then infers the plan from `encoders`.
    encoder_plan: tuple[int, ...] = ()
    encoder_on_stage0: bool = False
    # Micro-batches without an image: no encoder action runs for them, backbone stage 0 takes
    # no encoder output for them and sends no gradient back (text-only samples skip the encoder).
    text_only: tuple[int, ...] = ()
    # Look-ahead micro-batches (the next step's coreset pool, `schedule/lookahead.py`): numbered
    # after the step's own, num_microbatches .. num_microbatches + lookahead - 1; forward only
    # (F and EF, no loss, no backward), they fill this step's bubbles.
    lookahead: int = 0
    # Backbone backwards split (zero-bubble's B / W): (stage, chunk, mb) whose B computes the
    # input gradient only and whose W action computes the weight gradients later.
    backbone_wgrad: tuple[tuple[int, int, int], ...] = ()

    def splits_backbone(self, a: Action) -> bool:
        """Whether backbone action `a`'s micro-batch has its backward split into B and W."""
        return (a.stage, a.chunk, a.mb) in self.backbone_wgrad

    def split_options(self) -> dict[str, bool]:
        """The `OptimusOptions` splits this schedule was built with (encoder, backbone)."""
        return {
            "wgrad_split": self.splits_weight_grads,
            "backbone_wgrad_split": bool(self.backbone_wgrad),
        }

    def has_images(self, mb: int) -> bool:
        return mb not in self.text_only

    @property
    def total_microbatches(self) -> int:
        """The step's micro-batches and its look-ahead ones."""
        return self.num_microbatches + self.lookahead

    @property
    def splits_weight_grads(self) -> bool:
        """Whether an encoder's backward is split into EB and EW actions."""
        return any(enc.wgt_kernels for enc in self.encoders)

    def trains(self, mb: int) -> bool:
        """Whether micro-batch `mb` runs backward (False for a look-ahead micro-batch)."""
        return mb < self.num_microbatches

    @property
    def num_virtual_stages(self) -> int:
        return self.pp * self.vpp

    def virtual_index(self, stage: int, chunk: int) -> int:
        return chunk * self.pp + stage

    def stage_chunk(self, virtual: int) -> tuple[int, int]:
        return virtual % self.pp, virtual // self.pp

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> ScheduleMeta:
        raw = json.loads(text)
        encoders = tuple(
            EncoderMeta(
                e["name"],
                tuple(e["fwd_kernels"]),
                tuple(e["bwd_kernels"]),
                tuple(tuple(tuple(ls) for ls in pipe) for pipe in e["placement"]),
                tuple(e.get("wgt_kernels", ())),
            )
            for e in raw.pop("encoders")
        )
        raw["backbone_layers"] = tuple(raw.get("backbone_layers", ()))
        raw["encoder_plan"] = tuple(raw.get("encoder_plan", ()))
        raw["text_only"] = tuple(raw.get("text_only", ()))
        raw["backbone_wgrad"] = tuple(tuple(x) for x in raw.get("backbone_wgrad", ()))
        return ScheduleMeta(encoders=encoders, **raw)


@dataclass(frozen=True)
class OptimusOptions:
    """One candidate of the planner's search."""

    encoder_plan: ParallelPlan
    split: str = "greedy"  # "greedy": any pipeline may take any micro-batch; "even": equal shares
    extra_warmup: int = 0  # extra 1F1B warm-up micro-batches on every stage
    fine: bool = True  # False: the coarse schedule only (all encoder work outside the backbone)
    placement: str = "colocated"  # "stage0": the Megatron placement, kept when nothing beats it
    even_backbone: bool = False  # Megatron's default even layer split (else balance the head)
    # Split the encoder's backward into input-gradient (EB) and weight-gradient (EW) work; the
    # weight gradients go into whatever bubble comes after their input gradient.
    wgrad_split: bool = False
    # Split the backbone's backward where a peer waits for its input gradient: the last
    # stage's first micro-batch (1F1B's warm-up) and every stage's last one (its drain); each
    # W goes into the first bubble after its B that holds it.
    backbone_wgrad_split: bool = False


@dataclass(frozen=True)
class LookaheadTimes:
    """What the cost model predicts for a step with the next coreset pool's forward merged in
    (`schedule.lookahead.with_lookahead`), against the step and the pool's pass alone."""

    step_s: float
    step_alone_s: float
    pool_alone_s: float

    @property
    def saving(self) -> float:
        """The pool's pass then the step, over the merged step."""
        return (self.step_alone_s + self.pool_alone_s) / self.step_s


@dataclass
class Schedule:
    """Per-rank ordered action lists (`ranks[r]` is rank r's program) and their metadata."""

    meta: ScheduleMeta
    ranks: list[list[Action]]
    origin: OptimusOptions | None = None  # the planner's candidate these lists were built from
    lookahead_times: LookaheadTimes | None = None  # set by with_lookahead
    # A look-ahead merge's own lists for fewer pool micro-batches going forward, by count
    # (`merge_search.with_searched_counts`); a count not here is this merge trimmed.
    fewer_ahead: dict[int, Schedule] = field(default_factory=dict, repr=False, compare=False)

    def encoder_assignment(self) -> list[dict[int, int]]:
        """For each encoder, micro-batch -> the encoder pipeline that runs it (from EF actions)."""
        out: list[dict[int, int]] = [dict() for _ in self.meta.encoders]
        for actions in self.ranks:
            for a in actions:
                if a.kind == "EF" and a.enc < len(out):
                    out[a.enc].setdefault(a.mb, a.pipe)
        return out

    def to_csv(self, path: str | Path | None = None) -> str:
        """One row per rank: the rank number then its actions. The first line holds the metadata."""
        buf = io.StringIO()
        buf.write("# meta " + self.meta.to_json() + "\n")
        writer = csv.writer(buf, lineterminator="\n")
        for rank, actions in enumerate(self.ranks):
            writer.writerow([rank, *map(str, actions)])
        text = buf.getvalue()
        if path is not None:
            Path(path).write_text(text)
        return text

    @staticmethod
    def from_csv(source: str | Path) -> Schedule:
        """Load what `to_csv` wrote (a path, or the text itself)."""
        p = Path(source) if not str(source).lstrip().startswith("#") else None
        if p is not None and not p.is_file():
            what = "is a directory" if p.is_dir() else "does not exist"
            raise ConfigError(f"schedule file {source} {what}; give a CSV written by to_csv")
        try:
            text = p.read_text() if p is not None else str(source)
        except UnicodeDecodeError:
            raise ConfigError(f"schedule file {source} is not text (not a schedule CSV)") from None
        where = str(p) if p is not None else "schedule CSV"
        if "\0" in text:
            raise ConfigError(f"{where} holds NUL bytes (not a schedule CSV)")
        lines = text.splitlines()
        if not lines or not lines[0].startswith("# meta "):
            raise ConfigError(f"{where}: first line must be '# meta {{...}}' as written by to_csv")
        try:
            meta = ScheduleMeta.from_json(lines[0][len("# meta ") :])
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"{where}: line 1 has malformed schedule metadata") from None
        ranks: list[list[Action]] = []
        for lineno, row in enumerate(csv.reader(lines[1:]), start=2):
            if not row:
                continue
            if not row[0].strip().isdigit() or int(row[0]) != len(ranks):
                raise ConfigError(
                    f"{where}: line {lineno} starts with '{row[0]}'; expected rank {len(ranks)}"
                )
            try:
                ranks.append([parse_action(cell) for cell in row[1:] if cell.strip()])
            except ConfigError as err:
                raise ConfigError(f"{where}: line {lineno}: {err}") from None
        if len(ranks) != meta.pp:
            raise ConfigError(f"{where}: {len(ranks)} rank rows but the metadata says PP={meta.pp}")
        return Schedule(meta, ranks)

    def grid(
        self, center: int | None = None, radius: int = 3, mark: tuple[int, int] | None = None
    ) -> str:
        """The action lists side by side, one column per rank (rows around `center` if given)."""
        depth = max((len(a) for a in self.ranks), default=0)
        lo, hi = (
            (0, depth)
            if center is None
            else (max(0, center - radius), min(depth, center + radius + 1))
        )
        cells = [[str(a) for a in actions] for actions in self.ranks]
        width = max([len(c) for col in cells for c in col] + [8]) + 2
        out = ["step  " + "".join(f"rank {r}".ljust(width) for r in range(len(self.ranks)))]
        for step in range(lo, hi):
            row = f"{step:<6}"
            for r, col in enumerate(cells):
                text = col[step] if step < len(col) else ""
                if mark == (r, step):
                    text = f">{text}<"
                row += text.ljust(width)
            out.append(row.rstrip())
        return "\n".join(out)
