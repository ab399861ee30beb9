"""--plan-candidates K: a plan is a hypothesis until it ran. The K plans the planner predicts
fastest (the Megatron schedule on our executor always among them; with --encoder-wgrad-split
the best one's split variant too) each train a few real steps, and the one that measured
fastest trains on (`candidate_run.py` runs the phase).

* The first `warmup` steps run on the planner's first choice, then `layout_warmup` steps
  (--plan-candidate-layout-warmup, default 3) on the first candidate of each other module
  layout (the modules' units run at another speed in each: an encoder replicated over the
  ranks reduces its gradients beside their compute, one on stage 0 runs its layers back to
  back); then every candidate is planned again and predicted from what the job measured on
  its own layout (`CandidateRun`).
* Candidates run in order of that prediction, `steps_each - 1` timed steps each, in windows
  mirrored around the phase's middle (A B C C B A, the middle one's two merged; each window's
  first step warms its candidate up and is not timed), so that a drift of the machine's speed
  over the phase weighs every candidate alike.
* A close call gets a second look: where the two fastest medians differ by less than the timed
  steps' own noise can tell apart (`close_call`), those two run one more round of mirrored
  windows, and the lower of their medians over both rounds is kept (the others, timed once, are
  out). Two plans that close cost about the same per step, so the round costs little beyond
  its switches.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace

from megatron_mllm.errors import ConfigError
from megatron_mllm.runtime.job import RuntimeJob, encoder_plan_of
from megatron_mllm.schedule.schedule import Schedule

# Steps a candidate trains by default: four timed (two a window), so that one noisy step does
# not decide; each window's first step warms it up.
STEPS_EACH = 5
# Warm-up steps on each module layout after the first: the first after the switch runs cold
# and is not read, the other two are.
LAYOUT_WARMUP = 3
# A close call: the two fastest medians less than this many standard errors of their
# difference apart (about 95% two-sided), the error estimated from the timed steps' spread.
CLOSE_CALL_Z = 2.0


@dataclass(frozen=True)
class Candidate:
    """One plan to try: its schedule, encoder unit size and start-up prediction."""

    label: str
    schedule: Schedule
    units: str = "layer"
    predicted_s: float = float("nan")
    workload: object = None  # its costs at start-up (a Workload)
    layout: int = 0  # its module layout's index in the phase (equal: the same modules)


@dataclass(frozen=True)
class CandidatePhase:
    """The candidates, in the planner's order, and how long each runs."""

    candidates: tuple[Candidate, ...]
    steps_each: int = STEPS_EACH
    # Six, the last three read: a job's first steps run slower than its later ones (memory
    # first touched, the optimizer's state made), which a prediction read from them carries.
    warmup: int = 6
    close_call_z: float = CLOSE_CALL_Z  # inf: always a second look (tests)
    # Warm-up steps on each other module layout; 0: every candidate is predicted from the first
    # plan's warm-up (the ablation).
    layout_warmup: int = LAYOUT_WARMUP

    def __post_init__(self) -> None:
        if not layout_warmup_fits(self.layout_warmup):
            raise ValueError(f"layout_warmup {self.layout_warmup}: 0 or at least 2")

    @property
    def calibration_steps(self) -> int:
        """The last steps of the first layout's warm-up the in-job plan reads (the first ones
        run cold)."""
        return max(self.warmup // 2, 1)

    @property
    def warmup_windows(self) -> list[tuple[int, int]]:
        """(candidate, steps) of the warm-up: the first candidate's `warmup`, then
        `layout_warmup` on the first candidate of each other module layout."""
        out, seen = [(0, self.warmup)], {_layout(self.candidates[0])}
        for i, c in enumerate(self.candidates if self.layout_warmup else ()):
            if _layout(c) not in seen:
                seen.add(_layout(c))
                out.append((i, self.layout_warmup))
        return out

    @property
    def warmup_steps(self) -> int:
        """Steps before the candidates' timed windows (every layout's warm-up)."""
        return sum(n for _, n in self.warmup_windows)

    def layout_of(self, i: int) -> int:
        """Candidate `i`'s module layout index."""
        return _layout(self.candidates[i])

    def read_steps(self) -> dict[int, range]:
        """Each module layout's warm-up steps the in-job plan reads, by layout index."""
        out, start = {}, 0
        for k, (i, n) in enumerate(self.warmup_windows):
            read = self.calibration_steps if k == 0 else n - 1
            out[_layout(self.candidates[i])] = range(start + n - read, start + n)
            start += n
        return out

    def warmup_candidate(self, step: int) -> int:
        """Which candidate trains warm-up step `step`."""
        start = 0
        for i, n in self.warmup_windows:
            if step < start + n:
                return i
            start += n
        raise ValueError(f"step {step} is after the warm-up")

    @property
    def steps(self) -> int:
        """Steps until the kept plan runs alone (at most: candidates that re-planning makes one
        run once; a second look only at a close call)."""
        n = len(self.candidates)
        second = self.second_look_steps if n > 1 else 0
        return self.end(windows(list(range(n)), self.steps_each)) + second

    @property
    def second_look_steps(self) -> int:
        """The steps a close call's second look adds (none with one timed step per window:
        then there is no spread to call it close by)."""
        if self.steps_each < 3:
            return 0
        return sum(n for _, n in windows([0, 1], self.steps_each))

    def end(self, ran: list[tuple[int, int]]) -> int:
        """The step after the phase when its windows after warm-up are `ran`."""
        return self.warmup_steps + sum(n for _, n in ran)


def _layout(candidate: Candidate | None) -> int:
    """A candidate's module layout index (0 for a stand-in without one)."""
    return getattr(candidate, "layout", 0)


def windows(order: list[int], steps_each: int) -> list[tuple[int, int]]:
    """(candidate, steps) in the order they run after warm-up: each candidate's
    `steps_each - 1` timed steps split into two windows mirrored around the phase's middle
    (A B C C B A, the middle candidate's two merged), each window one warm-up step longer."""
    timed = steps_each - 1
    first, second = timed - timed // 2, timed // 2
    if not second:
        return [(i, 1 + timed) for i in order]
    head = [(i, 1 + first) for i in order[:-1]]
    return head + [(order[-1], 1 + timed)] + [(i, 1 + second) for i in reversed(order[:-1])]


def after_warmup(ran: list[tuple[int, int]]) -> list[tuple[int, bool]]:
    """(candidate, timed) of every step after warm-up, the windows `ran` laid out step by
    step."""
    return [(i, k > 0) for i, n in ran for k in range(n)]


def timed_windows(ran: list[tuple[int, int]], warmup: int) -> dict[int, list[list[int]]]:
    """Each candidate's timed steps (indices from the run's first step), window by window, when
    the windows `ran` followed `warmup` steps."""
    out: dict[int, list[list[int]]] = {i: [] for i, _ in ran}
    start = warmup
    for i, n in ran:
        out[i].append(list(range(start + 1, start + n)))  # its first step warms it up
        start += n
    return out


def timed_steps(ran: list[tuple[int, int]], warmup: int) -> dict[int, list[int]]:
    """Each candidate's timed steps (indices from the run's first step) when the windows `ran`
    followed `warmup` steps."""
    return {i: [s for w in ws for s in w] for i, ws in timed_windows(ran, warmup).items()}


def fastest(
    seconds: list[float], ran: list[tuple[int, int]], warmup: int, among=None
) -> tuple[int, dict]:
    """The candidate kept and each one's timed step seconds, from every step's seconds (the
    slowest rank's) when the windows `ran` followed `warmup` steps: the lowest median (of
    those in `among`, every one that ran if None); ties go to the earlier candidate."""
    steps = timed_steps(ran, warmup)
    timed = {i: [seconds[s] for s in at] for i, at in steps.items()}
    best = min(among or timed, key=lambda i: (statistics.median(timed[i]), i))
    return best, timed


def close_call(timed: dict[int, list[float]], z: float = CLOSE_CALL_Z) -> tuple[int, int] | None:
    """(fastest, runner-up) where their medians differ by less than `z` standard errors of the
    difference, the per-step noise estimated robustly from every candidate's timed steps about
    its own median; None where one is clearly fastest, or with fewer than two timed steps
    each (no spread to judge by)."""
    medians = {i: statistics.median(v) for i, v in timed.items()}
    ranked = sorted(timed, key=lambda i: (medians[i], i))
    if len(ranked) < 2 or min(len(v) for v in timed.values()) < 2:
        return None
    first, second = ranked[:2]
    if math.isinf(z):
        return first, second
    deviations = [abs(t - medians[i]) for i, v in timed.items() for t in v]
    sigma = 1.4826 * statistics.median(deviations)  # the MAD of a normal's spread
    n = min(len(timed[first]), len(timed[second]))
    error = math.sqrt(math.pi / 2) * sigma * math.sqrt(2 / n)  # two medians' difference
    return (first, second) if medians[second] - medians[first] < z * error else None


def layout_warmup_fits(n: int) -> bool:
    """A layout warm-up of `n` steps: none, or one after the switch that is not read and more."""
    return n == 0 or n >= 2


def most_steps(k: int, splits: int, steps_each: int, layout_warmup: int) -> int:
    """The longest phase K plans, the Megatron schedule and `splits` split variants can take:
    each plan on its own module layout (the split variants on the first's)."""
    stand_ins = [Candidate(f"plan {j}", None, layout=j) for j in range(k + 1)]
    stand_ins += [Candidate("split", None)] * splits
    return CandidatePhase(tuple(stand_ins), steps_each, layout_warmup=layout_warmup).steps


def check_counts(k: int, steps_each: int, layout_warmup: int = LAYOUT_WARMUP) -> None:
    """K plans and steps per candidate that a phase can run (ConfigError in one line)."""
    if not layout_warmup_fits(layout_warmup):
        raise ConfigError(
            f"--plan-candidate-layout-warmup {layout_warmup}: give 0 (predict every candidate "
            "from the first plan's warm-up) or at least 2 (the first step after a switch is "
            "not read)"
        )
    if k < 1:
        raise ConfigError(f"--plan-candidates {k}: give K >= 1, at least 1 of the planner's plans")
    if steps_each < 2:
        raise ConfigError(
            f"--plan-candidate-steps {steps_each}: give at least 2 steps (the first warms a "
            "candidate up, the rest are timed)"
        )


def check_phase(k: int, steps_each: int, job: RuntimeJob) -> None:
    """Refuse what cannot run candidates (before any process group)."""
    check_counts(k, steps_each)
    blockers = {
        "a coreset (its pool schedule is built for one layout)": job.data.coreset is not None,
        "optimus-adaptive (it plans every step itself)": job.executor.adaptive,
        "--replan-after-iters (the candidates are re-planned after warm-up)": (
            job.executor.replan_after is not None
        ),
        "dynamic mode": job.executor.dynamic,
        "megatron-core's own schedule (candidates run on our executor)": job.mode != "executor",
    }
    for what, present in blockers.items():
        if present:
            raise ConfigError(f"--plan-candidates cannot run with {what}; drop one of the two")


def plan_candidates(
    costs, k: int, unit: str = "layer", wgrad_split: bool = False, backbone_split: bool = False
) -> list[Candidate]:
    """The `k` module layouts the planner predicts fastest for `costs` (a JobCosts), each with
    its best schedule, and, where it is not among them, the Megatron schedule (encoder on stage
    0, balanced split) as the last. With `wgrad_split` the fastest Optimus layout's schedule
    with the encoder's backward split (B / W) is one more candidate on the same modules,
    whatever its prediction: the split is a bet the run can check; with `backbone_split` so is
    that layout's schedule with the backbone's backward split (and the encoder's, with both)."""
    from megatron_mllm.schedule.baselines import megatron_schedule
    from megatron_mllm.schedule.planner import plan_optimus, splits_backbone
    from megatron_mllm.schedule.simulator import simulate

    _, options, _ = plan_optimus(costs)
    memory = costs.job.hw.memory_gb
    # The Megatron schedule's encoder runs whole layers on stage 0 whatever the fill unit
    # (its candidate's units), so it is built from layer-unit costs.
    layers = costs.with_unit("layer")
    # One per module layout (encoder plan and placement): its best bubble-schedule variant, as
    # the in-job re-plan makes every candidate of one layout that layout's best anyway.
    best: dict[tuple, tuple] = {}
    for i, (o, t, peak) in enumerate(options):
        key = (o.encoder_plan, o.placement)
        if peak <= memory and (key not in best or t < best[key][0]):
            best[key] = (t, i, o)
    ranked = sorted(best.values())
    out: list[Candidate] = []
    for seconds, _, opts in ranked[:k]:
        if opts.placement == "stage0":
            schedule, workload = megatron_schedule(layers)
            out.append(Candidate("megatron", schedule, "layer", seconds, workload))
            continue
        out.append(_optimus_candidate(costs, opts, unit, seconds))
    first = next((opts for _, _, opts in ranked[:k] if opts.placement != "stage0"), None)
    splits = [dict(wgrad_split=True)] if wgrad_split else []
    if backbone_split and first is not None and splits_backbone(costs.job, first):
        splits.append(dict(wgrad_split=wgrad_split, backbone_wgrad_split=True))
    for split_opts in splits if first is not None else ():
        split = _optimus_candidate(costs, replace(first, **split_opts), unit)
        result = simulate(split.schedule, split.workload)
        split = replace(split, predicted_s=result.step_time_s)
        if result.peak_memory_gb <= memory:
            at = next((i for i, c in enumerate(out) if c.predicted_s > split.predicted_s), None)
            out.insert(len(out) if at is None else at, split)
    if not any(c.label == "megatron" for c in out):
        built = megatron_schedule(layers)
        seconds = simulate(*built).step_time_s
        out.append(Candidate("megatron", built[0], "layer", seconds, built[1]))
    return with_layouts(out, costs.job.plan)


def with_layouts(candidates: list[Candidate], backbone) -> list[Candidate]:
    """The candidates, each with its module layout's index (in order of first appearance)."""
    index: dict[tuple, int] = {}
    return [
        replace(c, layout=index.setdefault(layout_key(c.schedule, backbone, c.units), len(index)))
        for c in candidates
    ]


def _optimus_candidate(costs, opts, unit: str, seconds: float = float("nan")) -> Candidate:
    """The Optimus schedule `opts` give for `costs`, validated, as a candidate predicted to
    take `seconds`."""
    from megatron_mllm.schedule.bubble_scheduler import optimus_schedule
    from megatron_mllm.schedule.validator import validate

    schedule, workload = optimus_schedule(costs, opts)
    validate(schedule)
    fine = "fine" if opts.fine else "coarse"
    label = f"optimus {opts.encoder_plan} {opts.split} {fine} +{opts.extra_warmup}"
    label += " split" if opts.wgrad_split else ""
    label += " bb-split" if opts.backbone_wgrad_split else ""
    return Candidate(label, schedule, unit, seconds, workload)


def kept_plan(common: dict, costs) -> tuple | None:
    """(schedule, workload) of the plan a checkpoint's run kept after its candidate phase
    (its common state's "plan_candidates" record); None where it holds none. `costs`: the
    job's analytic JobCosts (the workload is rebuilt for the saved schedule's layout)."""
    from megatron_mllm.schedule.baselines import megatron_schedule
    from megatron_mllm.schedule.blocks import JobCosts
    from megatron_mllm.schedule.bubble_scheduler import OptimusOptions, optimus_schedule
    from megatron_mllm.schedule.validator import validate

    record = common.get("plan_candidates") or {}
    if record.get("schedule") is None:
        return None
    schedule = Schedule.from_csv(record["schedule"])
    validate(schedule)
    job = costs.job
    enc_plan, stage0 = encoder_plan_of(schedule, job.plan)
    if job.plan.vpp == 1:
        job = replace(job, backbone_split=tuple(schedule.meta.backbone_layers))
    built = JobCosts(job, unit=record["units"])
    split = schedule.meta.splits_weight_grads
    workload = (
        megatron_schedule(built)[1]
        if stage0
        else optimus_schedule(built, OptimusOptions(enc_plan, wgrad_split=split))[1]
    )
    workload.check_matches(schedule.meta)
    return schedule, workload


def layout_key(schedule: Schedule, backbone, units: str) -> tuple:
    """What a candidate's modules depend on: runs with equal keys share one set."""
    enc_plan, stage0 = encoder_plan_of(schedule, backbone)
    return (enc_plan, stage0, tuple(schedule.meta.backbone_layers), units)
