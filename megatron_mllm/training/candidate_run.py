"""The plan-candidate phase at run time (--plan-candidates; what the candidates are and when
each runs: `plan_candidates.py`): `CandidateRun` trains every step of the phase, switching
modules and schedules between candidates, plans them again from the job's measured times after
warm-up, and keeps the fastest measured.

* At start-up every distinct module layout among the candidates (encoder plan and placement,
  backbone split) is built once on the job's ranks; candidates that differ only in their bubble
  schedule share one. The start-up line says what that cost in seconds and parameter bytes.
* After warm-up (the first candidate's steps, then a few on each other module layout's first
  candidate) every candidate's schedule is planned again for its modules from the unit times
  measured in its layout's last warm-up steps (both ranks, its dtype, DDP and optimizer), the
  cost model's per-action overhead is the one measured there, its message latency is what a
  backbone activation's exchange between two stages measured beyond the model's figure
  (`runtime.planning.link_probe`), and what the layout's warm-up plan took beyond its
  simulated step is added to each of the layout's candidates; each candidate's step is
  predicted before its timed steps.
* Every step is a training step of the one run: a switch between layouts carries parameters,
  Adam moments and fp32 main values through a checkpoint in a scratch folder (the resume path:
  training/checkpointing.py), and every candidate reads the same data stream, so no sample is
  skipped or read twice.
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from megatron_mllm.runtime.job import RuntimeJob
from megatron_mllm.schedule.schedule import Schedule
from megatron_mllm.training.plan_candidates import (
    CandidatePhase,
    after_warmup,
    close_call,
    fastest,
    layout_key,
    windows,
)


@dataclass
class Row:
    """One candidate in the start-up table."""

    label: str
    predicted_startup_s: float
    predicted_s: float = float("nan")  # in the job, after warm-up, before it ran
    # The same with one latency per message fitted to the warm-up steps (the ablation)
    predicted_fitted_s: float = float("nan")
    measured_s: float = float("nan")
    kept: bool = False
    timed: list[float] = field(default_factory=list)
    same_as: str | None = None  # re-planned into another candidate's schedule: not run


class CandidateRun:
    """The Run protocol over K candidate plans (see the module's docstring); after the phase
    every attribute not its own is the kept run's."""

    def __init__(self, rank: int, world: int, job: RuntimeJob, device, phase: CandidatePhase):
        from megatron_mllm.runtime.modes.executor_run import ExecutorRun

        self.phase, self.rank = phase, rank
        self.jobs = [
            replace(job, plans=replace(job.plans, schedule=c.schedule, encoder_units=c.units))
            for c in phase.candidates
        ]
        self.rows = [Row(c.label, c.predicted_s) for c in phase.candidates]
        built: dict[tuple, ExecutorRun] = {}
        t0, self.runs, data = time.perf_counter(), [], None
        for j, c in zip(self.jobs, phase.candidates, strict=True):
            key = layout_key(j.schedule, j.backbone, j.plans.encoder_units)
            index = list(built).index(key) if key in built else len(built)
            if index != c.layout:  # the warm-up reads each layout's own units
                raise ValueError(f"candidate {c.label}: layout {c.layout}, built as {index}")
            if key not in built:
                built[key] = ExecutorRun(rank, world, j, device, data=data)
                data = built[key].data
            self.runs.append(built[key])
        self.build_s = time.perf_counter() - t0
        self.layouts = len(built)
        self.extra_state_bytes = sum(  # beyond one layout's: what the others hold meanwhile
            sum(_state_bytes(run).values()) for run in list(built.values())[1:]
        )
        self._set_order(list(range(len(self.runs))))
        self.current, self.kept, self.second_look = 0, None, None
        self.steps: list[dict] = []  # per step: what it measured and computed
        self.on_switch = None  # called with the new run (the LR scheduler follows it)
        self.scratch = None
        self.switch_s = self.plan_s = 0.0  # the phase's own cost beyond its training steps

    @property
    def run(self):
        return self.runs[self.current]

    def __getattr__(self, name: str):
        if name in ("runs", "current", "calibration", "kept", "phase_end") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.runs[self.current], name)

    # -- the Run protocol --------------------------------------------------------------------
    def step(self, step: int) -> None:
        want = self._candidate_at(step)
        if want != self.current or self.run.job.schedule is not self.jobs[want].schedule:
            self._switch(want, step)
        run = self.run
        if any(step == read.start for read in self.phase.read_steps().values()):
            run.unit_times.clear()  # what the in-job plan reads of this layout starts here
        run.step(step)
        self.steps.append(
            {
                "candidate": self.current,
                "seconds": run.seconds[-1],
                "history": run.history[-1],
                "mean_loss": run.mean_losses[-1],
                "breakdown": run.breakdowns[-1],
                "compute_seconds": run.compute_seconds[-1],
                "dp_seconds": run.dp_seconds[-1],
            }
        )
        if step + 1 == self.phase.warmup_steps:
            self._plan_in_job()
        if step + 1 == self.phase_end:
            self._phase_ends(step + 1)

    def replan(self) -> bool:
        return False

    def checkpoint_record(self) -> dict:
        """What a checkpoint keeps of the phase: the kept plan (None while it runs)."""
        if self.kept is None:
            return {"schedule": None}
        return {
            "kept": self.rows[self.kept].label,
            "schedule": self.jobs[self.kept].schedule.to_csv(),
            "units": self.jobs[self.kept].plans.encoder_units,
            "rows": [_finite(vars(r)) for r in self.rows],
        }

    def startup_line(self) -> str:
        """The start-up summary's line about the phase."""
        p = self.phase
        names = ", ".join(c.label for c in p.candidates)
        return (
            f" > plan candidates: {len(p.candidates)} ({names}) on {self.layouts} module "
            f"layout(s), built in {self.build_s:.1f} s with {self.extra_state_bytes / 1e6:.1f} "
            f"MB of model states beside the first's; {p.warmup_steps} warm-up steps ({p.warmup} "
            f"on the first, {p.layout_warmup} on each other layout's first), then "
            f"{p.steps_each - 1} timed each in mirrored windows, a second look at a close call "
            f"(iterations 1-{p.steps} at most)"
        )

    def table(self) -> str:
        """The phase's table (after it): predicted, measured, kept."""
        out = table(self.rows, self.build_s, self.layouts, self.extra_state_bytes)
        if self.second_look:
            a, b = (self.rows[i].label for i in self.second_look)
            out += f"\n   a close call: {a} and {b} ran a second round (measured: both rounds)"
        return (
            out + f"\n   the phase's own cost: re-planning {self.plan_s:.1f} s, switching layouts "
            f"{self.switch_s:.1f} s"
        )

    def result(self) -> dict:
        out = self.run.result()
        out.update(
            history=[s["history"] for s in self.steps],
            losses=self.steps[0]["history"],
            mean_losses=[s["mean_loss"] for s in self.steps],
            seconds=[s["seconds"] for s in self.steps],
            compute_seconds=[s["compute_seconds"] for s in self.steps],
            dp_seconds=[s["dp_seconds"] for s in self.steps],
            breakdowns=[s["breakdown"].as_dict() for s in self.steps],
            candidates=[vars(r) for r in self.rows],
            candidate_of_step=[s["candidate"] for s in self.steps],
            candidate_order=list(self.order),
            candidate_windows=[list(w) for w in self.ran],
            candidate_second_look=self.second_look,
            candidate_build_s=self.build_s,
            candidate_layouts=self.layouts,
            candidate_extra_state_bytes=self.extra_state_bytes,
            candidate_calibration=getattr(self, "calibration", None),
            candidate_plan_s=self.plan_s,
            candidate_switch_s=self.switch_s,
        )
        return out

    # -- the phase ---------------------------------------------------------------------------
    def _candidate_at(self, step: int) -> int:
        """Which candidate trains step `step`."""
        if self.kept is not None:
            return self.kept
        if step < self.phase.warmup_steps:
            return self.phase.warmup_candidate(step)
        at = min(step - self.phase.warmup_steps, len(self._step_candidates) - 1)
        return self._step_candidates[at][0]

    def _set_order(self, order: list[int]) -> None:
        """Candidates run in `order` (each step's candidate laid out once, not per step)."""
        self.order = order
        self._set_windows(windows(order, self.phase.steps_each))

    def _set_windows(self, ran: list[tuple[int, int]]) -> None:
        """The phase runs the windows `ran` after warm-up, and ends after them."""
        self.ran = ran
        self._step_candidates = after_warmup(ran)  # (candidate, timed) per step
        self.phase_end = self.phase.end(ran)

    def _switch(self, want: int, iteration: int) -> None:
        """Train on candidate `want` from step `iteration` (collective)."""
        t0 = time.perf_counter()
        try:
            self._switch_to(want, iteration)
        finally:
            self.switch_s += time.perf_counter() - t0

    def _switch_to(self, want: int, iteration: int) -> None:
        src, dst = self.run, self.runs[want]
        if dst is not src:
            self._transfer(src, dst, iteration)
            for name in ("skipped_iterations", "last_loss", "last_grad_norm"):
                setattr(dst, name, getattr(src, name, float("nan")))
        dst.use_schedule(self.jobs[want].schedule)
        self.current = want
        if self.on_switch is not None and dst is not src:
            self.on_switch(dst)

    def _transfer(self, src, dst, iteration: int) -> None:
        """Parameters, moments and main values from `src`'s modules into `dst`'s, through a
        checkpoint in a scratch folder (collective)."""
        from megatron_mllm.models.weights import open_full_state, shapes_of
        from megatron_mllm.training import checkpointing
        from megatron_mllm.training.resume import checkpoint_parts

        if self.scratch is None:
            self.full_shapes = shapes_of(open_full_state(src.job.model.weights))
            box = [_scratch_dir() if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(box, src=0)
            self.scratch = box[0]
        src.sync_params()
        common = {"iteration": iteration}
        checkpointing.save(
            self.scratch, iteration, checkpoint_parts(src), self.full_shapes, src.optimizer, common
        )
        checkpointing.load(self.scratch, checkpoint_parts(dst), self.full_shapes, dst.optimizer)
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(checkpointing.checkpoint_dir(self.scratch, iteration))

    def _plan_in_job(self) -> None:
        """After warm-up (collective): every candidate re-planned and predicted from the job's
        measured unit times, overhead and message latency; run in that order."""
        t0 = time.perf_counter()
        try:
            self._plan_from_measured()
        finally:
            self.plan_s = time.perf_counter() - t0

    def _plan_from_measured(self) -> None:
        from megatron_mllm.runtime.planning.replan import calibrated, measured_workload
        from megatron_mllm.schedule.simulator import simulate

        reads = self.phase.read_steps()
        measured = {}  # layout -> (its units as measured, its calibration)
        for i, _ in self.phase.warmup_windows:
            run, layout = self.runs[i], self.phase.layout_of(i)
            gathered = run.gathered_unit_times()
            measured[layout] = gathered, self._calibration(gathered, run, len(reads[layout]))
        opening = measured[self.phase.layout_of(0)]
        self.calibration = {**opening[1], "by_layout": [cal for _, cal in measured.values()]}
        for i, cand_job in enumerate(self.jobs):
            gathered, cal = measured.get(self.phase.layout_of(i), opening)  # not warmed up
            self.jobs[i] = cand_job = self._replanned(cand_job, gathered)
            workload = measured_workload(cand_job, gathered)
            if workload is not None:
                calib = calibrated(workload, cal["overhead_s"], cal["latency_s"])
                simulated = simulate(cand_job.schedule, calib).step_time_s
                self.rows[i].predicted_s = simulated + cal["unexplained_s"]
                fitted = calibrated(workload, cal["overhead_s"], cal["fitted_latency_s"])
                self.rows[i].predicted_fitted_s = simulate(cand_job.schedule, fitted).step_time_s
        # Re-planned for the same modules, candidates may meet in one schedule: it runs once.
        first: dict[tuple, int] = {}
        for i, cand_job in enumerate(self.jobs):
            same = first.setdefault(_ranks(cand_job.schedule), i)
            if same != i:
                self.rows[i].same_as = self.rows[same].label
        unique = [i for i in range(len(self.jobs)) if self.rows[i].same_as is None]
        self._set_order(sorted(unique, key=lambda i: (self.rows[i].predicted_s, i)))

    def _calibration(self, gathered: list[dict], run, n: int) -> dict:
        """The cost model's terms measured on a layout's warm-up plan over its last `n` steps
        in `run` (collective): the host overhead per action, a backbone activation's one-way
        time and the latency it adds beyond the model's figure, the DP collectives' rates (in
        `gathered`), and the seconds its steps took beyond its simulated step (charged to every
        candidate of the layout alike: what no action holds, and the model's error on it)."""
        from megatron_mllm.runtime.planning.link_probe import message_latency, message_seconds
        from megatron_mllm.runtime.planning.replan import (
            calibrated,
            fitted_latency,
            measured_workload,
        )
        from megatron_mllm.schedule.simulator import simulate

        last = [None] * dist.get_world_size()
        steps = zip(run.seconds[-n:], run.breakdowns[-n:], strict=True)
        dist.all_gather_object(last, [(s, b.overhead_per_action_s) for s, b in steps])
        measured_s = statistics.median(max(r[i][0] for r in last) for i in range(n))
        overhead = statistics.median(o for r in last for _, o in r)
        one_way = message_seconds(run.job, run.device, run.job.model.dtype, groups=run.pair_groups)
        ran = measured_workload(run.job, gathered)
        out = {"overhead_s": overhead, "latency_s": 0.0, "message_s": one_way}
        out["dp_gbps"] = {key[2]: v[-1] for key, v in gathered[0].items() if key[0] == "dp"}
        if ran is None:
            return {**out, "unexplained_s": 0.0, "fitted_latency_s": 0.0}
        latency = message_latency(one_way, ran.transfer_s.get("act", 0.0))
        simulated = simulate(run.job.schedule, calibrated(ran, overhead, latency)).step_time_s
        return {
            **out,
            "latency_s": latency,
            "unexplained_s": measured_s - simulated,
            "fitted_latency_s": fitted_latency(run.job.schedule, ran, overhead, measured_s),
        }

    def _replanned(self, job: RuntimeJob, gathered: list[dict]) -> RuntimeJob:
        """An Optimus candidate planned again for its modules from the measured times."""
        from megatron_mllm.runtime.planning.replan import replan_job

        out = replan_job(job, gathered)
        if out is None:
            return job
        return replace(job, plans=replace(job.plans, schedule=out[0]))

    def _phase_ends(self, iteration: int) -> None:
        """After the phase's windows (collective): at a close call between the two fastest, a
        second look at them (once); else the fastest is kept."""
        seconds = torch.tensor([s["seconds"] for s in self.steps], dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        best, timed = fastest(seconds.tolist(), self.ran, self.phase.warmup_steps, self.second_look)
        pair = close_call(timed, self.phase.close_call_z) if self.second_look is None else None
        if pair is not None:
            self.second_look = sorted(pair, key=lambda i: i != self.current)  # no switch first
            self._set_windows(self.ran + windows(self.second_look, self.phase.steps_each))
            return
        self._keep(best, timed, iteration)

    def _keep(self, best: int, timed: dict, iteration: int) -> None:
        """Train on with candidate `best` alone (collective); `timed`: each one's timed steps."""
        for i, values in timed.items():
            self.rows[i].timed, self.rows[i].measured_s = values, statistics.median(values)
        self.rows[best].kept = True
        if best != self.current:
            self._switch(best, iteration)
        self.kept = best
        keep = self.runs[best]
        self.runs = [keep if r is keep else None for r in self.runs]  # free the others
        gc.collect()
        if self.scratch is not None and dist.get_rank() == 0:
            shutil.rmtree(self.scratch, ignore_errors=True)


def _state_bytes(run) -> dict:
    """An ExecutorRun's parameters, gradient buffers and optimizer state, in bytes."""
    from megatron_mllm.runtime.assembly.memory import model_state_bytes

    ddps = [d for sync in run.grad_sync.values() for d in sync.ddps]
    return model_state_bytes(run.rank_model.modules, ddps, run.optimizer)


def _finite(row: dict) -> dict:
    """A row for a checkpoint's common state: None for NaN (equal on every rank)."""
    return {k: (None if isinstance(v, float) and v != v else v) for k, v in row.items()}


def _ranks(schedule: Schedule) -> tuple:
    """A schedule's action lists, comparable."""
    return tuple(tuple(acts) for acts in schedule.ranks)


def _scratch_dir() -> str:
    """A private folder for the switch checkpoints (shared memory where there is some)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return tempfile.mkdtemp(prefix="megatron_mllm_candidates_", dir=base)


def table(rows: list, build_s: float, layouts: int, extra_bytes: int) -> str:
    """The start-up summary's candidate table (after the phase)."""
    lines = [
        f" > plan candidates: {len(rows)} plans on {layouts} module layout(s), built in "
        f"{build_s:.1f} s, {extra_bytes / 1e6:.1f} MB of model states held beside the first "
        "layout's during the phase (Adam moments once a layout has run: more)",
        f"   {'candidate':<40}{'predicted at start':>20}{'predicted in job':>18}"
        f"{'measured':>10}  kept",
    ]
    for r in rows:
        r = r if isinstance(r, dict) else vars(r)
        if r.get("same_as"):
            lines.append(f"   {r['label']:<40}  re-planned into the schedule of {r['same_as']}")
            continue
        lines.append(
            f"   {r['label']:<40}{1e3 * r['predicted_startup_s']:>17.1f} ms"
            f"{1e3 * r['predicted_s']:>15.1f} ms{1e3 * r['measured_s']:>7.1f} ms  "
            f"{'yes' if r['kept'] else ''}"
        )
    return "\n".join(lines)
