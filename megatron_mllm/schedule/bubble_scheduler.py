"""Optimus: encoder work scheduled into the backbone's bubbles (DESIGN 2.2).

1. The backbone alone, as the user configured it, is simulated once: its timeline fixes the
   dependency points F_i (stage 0 starts micro-batch i) and B_i (stage 0 finishes its backward),
   and the idle compute time on every rank: pipeline gaps and the TP bubbles inside each action.
2. Encoder forwards are packed as late as possible before F_i, at kernel granularity, taking
   micro-batches by decreasing F_i and giving each to the encoder pipeline that can start it
   latest (global ordering by completion time). What does not fit in a bubble goes before the
   backbone's first compute (the coarse schedule's place for all of it).
3. Encoder backwards are packed as early as possible after B_i; what does not fit goes after
   the backbone's last compute.
The lists are then assembled with their transfers, validated and simulated; the planner keeps
the best of the candidates it tries.
"""

from __future__ import annotations

import math
from dataclasses import replace

from megatron_mllm.parallel.plans import ParallelPlan, encoder_stage_placement
from megatron_mllm.schedule.actions import AG, EB, EF, EW, RS, Action, W
from megatron_mllm.schedule.assemble import EncoderLayout, assemble, megatron_backbone
from megatron_mllm.schedule.backbone_wgrad import backbone_wgrad_points, check_backbone_tp
from megatron_mllm.schedule.blocks import JobCosts, concat
from megatron_mllm.schedule.cost_model import Kernel
from megatron_mllm.schedule.gaps import Gap, GapPool, Placed
from megatron_mllm.schedule.keys import TensorKey, part_name
from megatron_mllm.schedule.pipeline_orders import backbone_actions, backbone_orders
from megatron_mllm.schedule.schedule import OptimusOptions, Schedule, ScheduleMeta
from megatron_mllm.schedule.simulator import simulate
from megatron_mllm.schedule.transfers import add_transfers
from megatron_mllm.schedule.workload import Workload, with_weight_split


def encoder_layouts(costs: JobCosts, enc_plan: ParallelPlan) -> tuple[list[EncoderLayout], int]:
    """Stages and placement of every encoder under `enc_plan`; also the slots per rank.

    See `parallel.plans.encoder_stage_placement` for where each stage sits.
    """
    plan = costs.job.plan
    placement = encoder_stage_placement(plan, enc_plan)
    slots = plan.tp // enc_plan.tp
    layouts = []
    for e in range(len(costs.job.encoders)):
        blocks = costs.encoder_blocks(e, enc_plan.tp)
        layers, projector = blocks[:-1], blocks[-1]
        base, rest = divmod(len(layers), enc_plan.pp)
        stages, i = [], 0
        for j in range(enc_plan.pp):
            n = base + (1 if j < rest else 0)
            part = layers[i : i + n] + ([projector] if j == enc_plan.pp - 1 else [])
            stages.append(concat(part, coalesce=False))
            i += n
        layouts.append(EncoderLayout(stages, enc_plan, placement))
    return layouts, slots


def encoder_dp_seconds(costs: JobCosts, enc_plan: ParallelPlan) -> float:
    """Data-parallel all-gather plus reduce-scatter time of the largest encoder stage.

    The rank's DP stream runs them besides the backbone's, so the step cannot be shorter than the
    backbone alone plus this (the planner's pruning bound).
    """
    layouts, _ = encoder_layouts(costs, enc_plan)
    cm = costs.cm
    return sum(
        max(
            cm.dp_gather_s(b.params, enc_plan.dp)
            + cm.dp_reduce_scatter_s(b.trainable_params, enc_plan.dp)
            for b in lay.stages
        )
        for lay in layouts
    )


def backbone_alone_seconds(costs: JobCosts) -> float:
    """The simulated step of the backbone alone under the job's plan and Optimus's layer split,
    no encoder work anywhere: no schedule that keeps that backbone is faster."""
    plan = costs.job.plan
    enc_plan = ParallelPlan(plan.dp * plan.tp * plan.pp, 1, 1)  # any; its work is left out
    backbone, layers = megatron_backbone(costs, 0.0)
    meta, workload = assemble(
        "backbone", costs, backbone, encoder_layouts(costs, enc_plan)[0], 1, backbone_layers=layers
    )
    steps = [backbone_actions(r, o) for r, o in enumerate(backbone_orders(meta))]
    return _BackboneTimeline(meta, workload, steps, fine=False).step_time_s


def backbone_step_seconds(cache: dict) -> float:
    """The backbone-alone step time of any timeline in `cache` (they share the backbone)."""
    return min(t.step_time_s for t in cache.values() if isinstance(t, _BackboneTimeline))


def optimus_schedule(
    costs: JobCosts,
    opts: OptimusOptions,
    cache: dict | None = None,
    loads: tuple[float, ...] = (),
    skip_text_only: bool = True,
) -> tuple[Schedule, Workload]:
    """Build the Optimus schedule for one encoder plan and options (not yet validated).

    `cache` (any dict, reused across calls for the same job) keeps the backbone timeline, which
    does not depend on the encoder plan nor on the encoder loads. `loads`: each micro-batch's
    encoder load (see `Workload.encoder_load`), placed as it is; with `skip_text_only` a
    micro-batch of load 0 gets no encoder action (`ScheduleMeta.text_only`).
    """
    shape = ("assembled", opts.encoder_plan, opts.even_backbone, opts.wgrad_split)
    shape += (opts.backbone_wgrad_split,)
    if cache is not None and shape in cache:
        meta, workload = cache[shape]
    else:
        layouts, slots = encoder_layouts(costs, opts.encoder_plan)
        backbone, layers = megatron_backbone(costs, 0.0, even=opts.even_backbone)
        meta, workload = assemble(
            "optimus", costs, backbone, layouts, slots=slots, backbone_layers=layers
        )
        if opts.wgrad_split:
            meta, workload = with_weight_split(meta, workload)
        if opts.backbone_wgrad_split:
            check_backbone_tp(costs.job.plan.tp)
            meta = replace(meta, backbone_wgrad=backbone_wgrad_points(meta))
        if cache is not None:
            cache[shape] = meta, workload
    if loads:
        workload = workload.at_loads(loads)
        if skip_text_only:
            meta = replace(meta, text_only=tuple(m for m, x in enumerate(loads) if x == 0))
    steps = [backbone_actions(r, o) for r, o in enumerate(backbone_orders(meta, opts.extra_warmup))]
    key = (opts.extra_warmup, opts.fine, meta.backbone_wgrad)
    if cache is None or key not in cache:
        timeline = _BackboneTimeline(meta, workload, steps, opts.fine)
        if cache is not None:
            cache[key] = timeline
    else:
        timeline = cache[key]
    # The encoders' parameter all-gathers run first on each rank's DP stream and push the
    # backbone back by as much.
    delay = max(
        (t for (r, kind, part), t in workload.dp_s.items() if kind == "AG" and part != "bb"),
        default=0.0,
    )
    placer = _Placer(meta, workload, steps, timeline, delay)
    placer.place_forwards(opts.split)
    placer.place_backwards()
    placer.place_backbone_weight_grads({p: t + delay for p, t in timeline.b_ends.items()})
    schedule = add_transfers(meta, placer.lists())
    schedule.origin = opts
    return schedule, workload


class _BackboneTimeline:
    """The backbone alone, simulated: dependency points and the idle time around its actions."""

    def __init__(
        self, meta: ScheduleMeta, workload: Workload, steps: list[list[Action]], fine: bool
    ) -> None:
        bb_meta = replace(meta, encoders=())
        bb_wl = replace(workload, encoder_fwd=[], encoder_bwd=[], encoder_act_bytes=[])
        bb = add_transfers(bb_meta, [[AG("bb"), *s, RS("bb")] for s in steps])
        sim = simulate(bb, bb_wl, keep_spans=False)
        self.step_time_s = sim.step_time_s
        self.f_start, self.b_end = sim.mb_forward_start, sim.mb_backward_end
        self.b_ends = {  # every backbone backward's end: (stage, chunk, mb) -> seconds
            (a.stage, a.chunk, a.mb): sim.action_times[(r, i)][1]
            for r, acts in enumerate(bb.ranks)
            for i, a in enumerate(acts)
            if a.kind == "B"
        }
        # Per rank: (start, end, anchor, cover) of every gap, before slots are known.
        self.gaps: list[list[tuple[float, float, tuple, float]]] = []
        for r, acts in enumerate(bb.ranks):
            mains = [i for i, a in enumerate(acts) if a.kind in ("F", "B")]
            gaps, prev = [], -math.inf
            for j, i in enumerate(mains):
                start, end = sim.action_times[(r, i)]
                if fine or j == 0:
                    gaps.append((prev, start, ("after", j - 1), 0.0))
                if fine:
                    gaps += self._tp_gaps(meta, workload, j, acts[i], start)
                prev = end
            gaps.append((prev, math.inf, ("after", len(mains) - 1), 0.0))
            self.gaps.append(gaps)

    @staticmethod
    def _tp_gaps(
        meta: ScheduleMeta, wl: Workload, j: int, action: Action, start: float
    ) -> list[tuple]:
        split = action.kind == "B" and meta.splits_backbone(action)
        kernels = wl.kernels(action.kind, action.stage, action.chunk, split=split)
        out, t, n = [], start, 0
        for i, k in enumerate(kernels):
            t += k.compute_s
            if k.comm_s > 0:
                # An encoder collective started after this bubble must hide under the compute
                # before the backbone's next collective.
                cover = 0.0
                for nxt in kernels[i + 1 :]:
                    cover += nxt.compute_s
                    if nxt.comm_s > 0:
                        break
                out.append((t, t + k.comm_s, ("tp", j, n), cover))
                t += k.comm_s
                n += 1
        return out


class _Placer:
    """Packs encoder kernels around one fixed backbone timeline."""

    def __init__(
        self,
        meta: ScheduleMeta,
        workload: Workload,
        steps: list[list[Action]],
        timeline: _BackboneTimeline,
        delay: float,
    ) -> None:
        self.meta, self.wl, self.steps = meta, workload, steps
        self.f_start = {m: t + delay for m, t in timeline.f_start.items()}
        self.b_end = {m: t + delay for m, t in timeline.b_end.items()}
        self.pool = GapPool()
        hosts = {rs for enc in meta.encoders for pipe in enc.placement for rs in pipe}
        hosts |= {(stage, 0) for stage, _, _ in meta.backbone_wgrad}
        for r, slot in sorted(hosts):
            for start, end, anchor, cover in timeline.gaps[r]:
                self.pool.add(r, slot, Gap(start + delay, end + delay, anchor, cover))
        self.pool.finish()
        self.placed: list[tuple[Action, Gap, float]] = []  # chunk, its gap, planned start
        self.assignment: list[dict[int, int]] = [dict() for _ in meta.encoders]

    def _transfer(self, key: TensorKey, src: int, dst: int) -> float:
        return self.wl.transfer_time(key) if src != dst else 0.0

    # -- forward ---------------------------------------------------------------------------
    def _forward_trial(self, e: int, pipe: int, mb: int) -> list[list[Placed]]:
        enc = self.meta.encoders[e]
        last = enc.num_stages - 1
        lane = enc.placement[pipe][last][0]
        deadline = self.f_start[mb] - self._transfer(TensorKey.eout(e, mb), lane, 0)
        out = []
        for j in range(last, -1, -1):
            rank, slot = enc.placement[pipe][j]
            # A TP-bubble fill cannot wait for a RECV (it would hold up the backbone action).
            kernels = self.wl.kernels("EF", j, enc=e, mb=mb)
            placed = self.pool.place_alap(rank, slot, kernels, deadline, first_in_tp=j == 0)
            out.append(placed)
            if j > 0:
                prev = enc.placement[pipe][j - 1][0]
                deadline = placed[0].start - self._transfer(TensorKey.eact(e, j, mb), prev, rank)
        return out[::-1]

    def place_forwards(self, split: str) -> None:
        """Micro-batches (those with images) by decreasing F_i, each to the pipeline that can
        start it latest; `split`: "greedy" (any pipeline) or "even" (equal counts), the
        lightest-loaded free pipeline of each row tried."""
        meta = self.meta
        mbs = [m for m in range(meta.num_microbatches) if meta.has_images(m)]
        for e, enc in enumerate(meta.encoders):
            pipes = enc.num_pipes
            count, load = [0] * pipes, [0.0] * pipes
            quota = math.ceil(len(mbs) / pipes) if split == "even" else len(mbs)
            slots = meta.slots
            for mb in sorted(mbs, key=lambda m: -self.f_start[m]):
                best = None
                for row in range(pipes // slots):
                    free = [p for p in range(row * slots, (row + 1) * slots) if count[p] < quota]
                    if not free:
                        continue
                    pipe = min(free, key=lambda p: load[p])
                    trial = self._forward_trial(e, pipe, mb)
                    score = trial[0][0].start
                    if best is None or score > best[0] + 1e-12:
                        best = (score, pipe, trial)
                _, pipe, trial = best
                count[pipe] += 1
                load[pipe] += self.wl.load_of(mb)
                self.assignment[e][mb] = pipe
                for j, placed in enumerate(trial):
                    self._commit("EF", e, pipe, j, mb, placed)

    # -- backward --------------------------------------------------------------------------
    def place_backwards(self) -> None:
        """Encoder backwards as early as possible after B_i, micro-batch by micro-batch; with
        a split backward the input gradients first, then every weight gradient as early as
        possible after its own input gradient, into what is left."""
        weights: list[tuple[float, int, int, int, int]] = []  # (earliest, e, pipe, stage, mb)
        for e, enc in enumerate(self.meta.encoders):
            if enc.trainable:
                weights += self._place_input_grads(e, enc)
        for earliest, e, pipe, j, mb in sorted(weights):
            rank, slot = self.meta.encoders[e].placement[pipe][j]
            kernels = self.wl.kernels("EW", j, enc=e, mb=mb)
            placed = self.pool.place_asap(rank, slot, kernels, earliest)
            self._commit("EW", e, pipe, j, mb, placed)

    def place_backbone_weight_grads(self, b_ends: dict[tuple[int, int, int], float]) -> None:
        """Each split backbone backward's W, as one piece, into the first bubble after its B
        that holds it (between backbone actions, never inside a TP collective's wait); what
        fits nowhere goes after the rank's last backbone action."""
        for point in sorted(self.meta.backbone_wgrad, key=lambda p: b_ends[p]):
            stage, chunk, mb = point
            kernels = self.wl.kernels("W", stage, chunk, mb=mb)
            whole = [Kernel("w", sum(k.compute_s for k in kernels))]
            placed = self.pool.place_asap(stage, 0, whole, b_ends[point], first_in_tp=False)
            self.pool.commit(stage, 0, placed)
            self.placed.append((W(stage, mb, chunk), placed[0].gap, placed[0].start))

    def _place_input_grads(self, e: int, enc) -> list[tuple[float, int, int, int, int]]:
        """EB of every micro-batch of encoder `e`; the weight gradients still to place."""
        weights = []
        last = enc.num_stages - 1
        for mb in sorted(self.assignment[e], key=lambda m: self.b_end[m]):
            pipe = self.assignment[e][mb]
            lane = enc.placement[pipe][last][0]
            earliest = self.b_end[mb] + self._transfer(TensorKey.egrad(e, mb), 0, lane)
            for j in range(last, -1, -1):
                kernels = self.wl.kernels("EB", j, enc=e, mb=mb)
                if not kernels:
                    break
                rank, slot = enc.placement[pipe][j]
                remote = j < last or lane != 0
                placed = self.pool.place_asap(rank, slot, kernels, earliest, first_in_tp=not remote)
                self._commit("EB", e, pipe, j, mb, placed)
                if enc.wgt(j):  # its weight gradients may start once its EB is done
                    weights.append((placed[-1].end + kernels[-1].comm_s, e, pipe, j, mb))
                if j > 0:
                    nxt = enc.placement[pipe][j - 1][0]
                    earliest = (
                        placed[-1].end
                        + kernels[-1].comm_s
                        + self._transfer(TensorKey.egin(e, j - 1, mb), rank, nxt)
                    )
        return weights

    def _commit(self, kind: str, e: int, pipe: int, stage: int, mb: int, placed: list[Placed]):
        rank, slot = self.meta.encoders[e].placement[pipe][stage]
        self.pool.commit(rank, slot, placed)
        make = {"EF": EF, "EB": EB, "EW": EW}[kind]
        run: list[Placed] = []
        for p in placed + [None]:
            if run and (p is None or p.gap is not run[-1].gap):
                g = run[0].gap
                fill = g.anchor[2] if g.is_tp else None
                chunk = make(e, pipe, stage, mb, run[0].kernel, run[-1].kernel + 1, fill)
                self.placed.append((chunk, g, run[0].start))
                run = []
            if p is not None:
                run.append(p)

    # -- lists -----------------------------------------------------------------------------
    def lists(self) -> list[list[Action]]:
        meta = self.meta
        by_anchor: dict[tuple, list[tuple[float, Action]]] = {}
        rank_of: dict[Action, int] = {}
        for chunk, gap, start in self.placed:
            if chunk.kind == "W":  # a backbone weight gradient: its stage's rank
                rank = chunk.stage
            else:
                rank = meta.encoders[chunk.enc].placement[chunk.pipe][chunk.stage][0]
            # TP fills of one backbone action are ordered by bubble, then by planned start.
            anchor = (rank, *gap.anchor[:2])
            by_anchor.setdefault(anchor, []).append(((gap.anchor[2:], start), chunk))
            rank_of[chunk] = rank
        for items in by_anchor.values():
            items.sort(key=lambda x: x[0])

        def at(*anchor) -> list[Action]:
            return [a for _, a in by_anchor.get(anchor, [])]

        out = []
        for r, steps in enumerate(self.steps):
            hosted = sorted({a.enc for a in rank_of if rank_of[a] == r and a.kind != "W"})
            trained = sorted({a.enc for a in rank_of if rank_of[a] == r and a.kind == "EB"})
            acts: list[Action] = (
                [AG(part_name(e)) for e in hosted] + [AG("bb")] + at(r, "after", -1)
            )
            for j, main in enumerate(steps):
                acts += at(r, "tp", j) + [main]
                after = at(r, "after", j)
                if j == len(steps) - 1:  # after the backbone's last work: its last W, if any
                    ws = [i + 1 for i, a in enumerate(after) if a.kind == "W"]
                    after.insert(max(ws, default=0), RS("bb"))
                acts += after
            acts += [RS(part_name(e)) for e in trained]
            out.append(acts)
        return out
