"""Runs one GPU's program on real megatron-core modules and torch.distributed.

Handlers, one per action kind (DeepSpeed's instruction -> handler map): backbone forward and
backward, encoder units forward and backward (and, with a split backward, their weight
gradients: `weight_grads.py`), the parts' DP gradient reductions (megatron-core's
DDP, `data_parallel.py`); messages go through `messages.py` (tagged on gloo, ordered
with lazily posted receives as NCCL needs); TP-bubble fills are paced by the plan
(`fill_pacing.py`). What really ran is recorded as trace spans in the simulator's format.

On a GPU's terms (a host that runs ahead of the device):
* every time is a StepClock mark, read after the one synchronize at step end, and the losses are
  read there too (no `.item()` per micro-batch);
* a tensor leaves the table once its last local consumer has read it and its last send is
  posted; pending sends are dropped as they complete; dynamic mode holds at most
  `max_encoder_ahead` encoder micro-batches run ahead of the program, and never more encoder
  activations at once than the static plan holds at its peak (what the planner costed).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable

import torch

from megatron_mllm.data.batch import MicroBatch
from megatron_mllm.models.config import MLLMConfig
from megatron_mllm.models.stages import BackboneStage, EncoderStage
from megatron_mllm.runtime.assembly.data_parallel import reductions_held
from megatron_mllm.runtime.engine.clock import StepClock
from megatron_mllm.runtime.engine.compute_actions import ComputeActions, planned_encoder_live
from megatron_mllm.runtime.engine.fill_pacing import FillPacer, fill_budgets, planned_bubbles
from megatron_mllm.runtime.engine.head_timing import HeadTimer
from megatron_mllm.runtime.engine.messages import Messages, PeerFailure
from megatron_mllm.runtime.engine.program import Op
from megatron_mllm.runtime.engine.step_types import PassKind, PassOptions, StepResult
from megatron_mllm.runtime.engine.weight_grads import weight_grads_of
from megatron_mllm.schedule.actions import ENCODER_KINDS, Action
from megatron_mllm.schedule.dataflow import Dataflow
from megatron_mllm.schedule.keys import TensorKey, part_encoder, part_name
from megatron_mllm.schedule.schedule import ScheduleMeta
from megatron_mllm.schedule.simulator import Span

__all__ = ["Executor", "PeerFailure", "StepResult"]


# The p2p span of the sends a rank still waits for after its program (breakdown key).
STEP_END_SENDS = "(in flight at step end)"


class Executor(ComputeActions):
    """Executes `program` (from `gpu_program`) once per training step."""

    def __init__(
        self,
        program: list[Op],
        meta: ScheduleMeta,
        cfg: MLLMConfig,
        rank: int,
        backbone: list[BackboneStage],
        encoder: EncoderStage | None,
        data: Callable[[int], MicroBatch],
        micro_batch: int,
        grad_sync: dict | None = None,
        options: PassOptions | None = None,
    ) -> None:
        options = options or PassOptions()
        timeout_s = options.timeout_s
        dynamic, ordered, overlap_fills = options.dynamic, options.ordered, options.overlap_fills
        recv_lookahead, max_encoder_ahead = options.recv_lookahead, options.max_encoder_ahead
        loss_scale, loss_norm = options.loss_scale, options.loss_norm
        after_program = options.after_program
        self.program, self.meta, self.cfg, self.rank = program, meta, cfg, rank
        # One module per virtual stage (model chunk) this rank holds; the last holds the loss.
        self.chunks = backbone
        # This GPU's stage of each encoder (None where it holds none), indexed by encoder.
        self.encoders = encoder if isinstance(encoder, list) else [encoder]
        self.backbone = backbone[-1]
        first = next(self.backbone.parameters())
        self.device = first.device  # buffers and batches go here
        self.dtype = first.dtype  # the pipeline dtype: messages and images in it
        # A frozen encoder trains its projector only: no gradient flows into its layers.
        self.encoder_frozen = [
            enc is not None
            and not any(
                p.requires_grad for n, p in enc.named_parameters() if not n.startswith("projector")
            )
            for enc in self.encoders
        ]
        self.data, self.micro_batch = data, micro_batch
        self.timeout_s = timeout_s
        # A pool pass (forward only, no graph): the last stage keeps its output layer's input;
        # an evaluation (forward only): the last stage computes losses and exact-match counts.
        self.evaluate = options.kind is PassKind.EVAL
        self.forward_only = options.kind is not PassKind.TRAIN
        # Dynamic mode: run ready encoder work while waiting for a message (see _fill_wait),
        # at most `max_encoder_ahead` encoder micro-batches ahead of the program.
        self.dynamic, self.max_encoder_ahead = dynamic, max_encoder_ahead
        self.encoder_live_budget = planned_encoder_live(program, meta)
        # Ordered mode (NCCL has no tags): (receive orders {src: keys in the sender's posting
        # order}, {(src, dst): a process group carrying only that direction}). Each sender's
        # receives are posted in its order, so matching by order is matching by key; they are
        # posted when needed, with `recv_lookahead` more (messages.py: each mode's default).
        self.ordered, self.recv_lookahead = ordered, recv_lookahead
        # Overlap: a backbone action's TP-bubble fills run while its TP collectives are in
        # flight (patches/async_tp_collectives.py), paced by the plan; the rest run after it.
        self.overlap_fills = overlap_fills
        # Each part's DP gradient reduction (data_parallel.PartGradSync by part: "bb", "e0", ...).
        self.grad_sync = grad_sync or {}
        self.loss_scale = loss_scale  # fp16: the loss is scaled before its backward (a tensor)
        # Per-token loss: each micro-batch's loss is its sum, times this before its backward
        # (DP size over the global batch's labelled tokens); None: its mean over micro-batches.
        self.loss_norm = loss_norm
        # Run once the program's last op has run, before the step-end waits (its result is
        # `picked`): the coreset look-ahead's selection on the last stage.
        self.after_program, self.picked = after_program, None
        self.flow = Dataflow(meta, [])  # what each action reads (needs use no assignment)
        self._planned = planned_bubbles(program)
        self._collectives: dict[tuple[str, int, int], int] = {}  # counted TP waits per action
        # Reference counts: how many local actions read each key, how many sends carry it.
        self._uses = Counter(
            k
            for op in program
            if op.kind == "run"
            for a in (*op.fills, op.action)
            for k in self._needs(a)
        )
        self._sends = Counter(op.key for op in program if op.kind == "send")
        self._receives = [op for op in program if op.kind == "recv"]  # in the program's order
        self.last_layer_inputs: dict[int, torch.Tensor] = {}
        # The LM head timed apart from the last stage's layers (its own unit, as profiled).
        self.head_timer = (
            HeadTimer(self.backbone, lambda: self.clock.mark(), not self.forward_only)
            if self.backbone.post_process
            else None
        )
        # A split encoder backward (EW actions): the linears' weight products wait for EW.
        split = meta.splits_weight_grads and not self.forward_only
        stages = [enc for enc in self.encoders if enc is not None]
        self.weight_grads = weight_grads_of(stages) if split and stages else None
        # A split backbone backward (W actions): the chunks' linears defer likewise.
        split_bb = bool(meta.backbone_wgrad) and not self.forward_only
        gpts = [chunk.gpt for chunk in self.chunks]
        self.bb_weight_grads = weight_grads_of(gpts, "--backbone-wgrad-split") if split_bb else None
        self._bb_input_grad: dict[tuple, tuple] = {}  # split B's (start, end, inside) marks
        self.handlers = {
            "F": self._forward,
            "B": self._backward,
            "W": self._backbone_wgrad,
            "EF": self._encoder_forward,
            "EB": self._encoder_backward,
            "EW": self._encoder_wgrad,
            "AG": self._all_gather,
            "RS": self._reduce_scatter,
        }

    # -- one step ------------------------------------------------------------------------------
    def run_step(self) -> StepResult:
        self._start_step()
        hooks = [self._capture_hook(), *(self.head_timer.attach() if self.head_timer else ())]
        try:
            with torch.no_grad() if self.forward_only else contextlib.nullcontext():
                self._run_program()
        finally:
            for hook in hooks:
                if hook is not None:
                    hook.remove()
        if self.after_program is not None:
            self.picked = self.after_program(self)
        start = self.clock.mark()
        self.messages.drain()  # sends still in flight wait for their receivers: a p2p wait
        self._span_later("p2p", Action("SEND", key=STEP_END_SENDS), "p2p", start, self.clock.mark())
        for key in sorted(self.grad_sync):  # one order on every rank (see data_parallel.py)
            start = self.clock.mark()
            self.grad_sync[key].finish()  # what of the reduction is not hidden: a DP span
            self._span_later("dp", Action("RS", key=key), "dp", start, self.clock.mark())
        self._finish_step()
        return self.result

    def _start_step(self) -> None:
        """Fresh per-step state; the clock starts here."""
        self.tensors: dict[str, torch.Tensor] = {}
        self.bb_ctx: dict[tuple, tuple] = {}
        self.enc_units: dict[tuple, list] = {}
        self.result = StepResult()
        self._batches: dict[int, tuple] = {}
        self._bwd_done: dict[tuple, int] = {}  # encoder backward units done per (e, s, mb)
        self._input_grad_marks: dict[tuple, tuple] = {}  # split backward: EB marks per unit
        self._uses_left, self._sends_left = Counter(self._uses), Counter(self._sends)
        self._losses: dict[int, torch.Tensor] = {}  # read once, at step end
        self._matches: dict[int, torch.Tensor] = {}  # evaluation: (exact, answered) per mb
        self._fill_marks: list[tuple] = []  # (start, end) marks of fills inside collectives
        self._ahead: dict[tuple[int, int], int] = {}  # dynamic: (enc, mb) -> op index moved
        self._later: list[Callable[[], None]] = []  # read marks after clock.finish()
        self._capture_next = False  # the next output-layer call is a pool micro-batch's
        self.clock = StepClock(self.device)
        self.messages = Messages(
            self.rank,
            self.device,
            self._shape,
            self.timeout_s,
            self.ordered,
            self.recv_lookahead,
            self.dtype,
            self._receives,
        )
        self._move_batches()

    def _capture_hook(self):
        """On the last stage, for a coreset pool's forward (a forward-only pass, or look-ahead
        micro-batches): keep the output layer's input per micro-batch."""
        pool = (self.forward_only and not self.evaluate) or self.meta.lookahead
        if not (pool and self.backbone.post_process):
            return None
        self._captured: list[torch.Tensor] = []

        def capture(module, args):
            if self._capture_next:
                self._captured.append(args[0].transpose(0, 1).detach())  # [b, s, h]

        return self.backbone.gpt.output_layer.register_forward_pre_hook(capture)

    def _finish_step(self) -> None:
        """The step's one synchronize; then every mark and loss is read. A split backward whose
        weight products no W or EW applied is an error (they would leak into the next step)."""
        for store in (self.weight_grads, self.bb_weight_grads):
            if store is not None and store.pending:
                left = sorted(store.pending)[:3]
                raise RuntimeError(f"rank {self.rank}: weight products of {left} never applied")
        end = self.clock.mark()
        self.clock.finish()
        for read in self._later:
            read()
        self.result.seconds = self.clock.since_start(end)
        self.result.losses = {mb: float(t) for mb, t in self._losses.items()}
        self.result.matches = {mb: tuple(t.tolist()) for mb, t in self._matches.items()}
        self.result.leftover_keys = sorted(self.tensors)
        self.result.max_posted_ahead = self.messages.max_posted_ahead
        self.result.planned_encoder_live = self.encoder_live_budget

    def _run_program(self) -> None:
        done = [False] * len(self.program)
        for i, op in enumerate(self.program):
            if done[i]:
                continue
            self.messages.reap()
            if op.kind == "run":
                self._run_op(op)
                continue
            start = self.clock.mark()
            if op.kind == "send":
                self._send(op)
            else:
                self._recv(op, i, done)
            action = Action(op.kind.upper(), key=op.key)
            self._span_later("p2p", action, "p2p", start, self.clock.mark())

    def _run_op(self, op: Op) -> None:
        if op.fills and self.overlap_fills:
            self._run_overlapped(op)
            return
        for fill in op.fills:  # sequential: the fills just before their backbone action
            self._run(fill)
        self._run(op.action)

    # -- messages ------------------------------------------------------------------------------
    def _send(self, op: Op) -> None:
        """Post a send; the table lets go of the tensor once no send or local use is left (the
        pending send keeps it alive until it completes)."""
        self.messages.send(op, self.tensors[op.key])
        self._sends_left[op.key] -= 1
        self._release(op.key)

    def _recv(self, op: Op, i: int, done: list[bool]) -> None:
        work, buf = self.messages.receive(op)
        if self.dynamic:
            self._fill_wait(work, i, done)
        self.messages.wait(work, op)
        self.messages.arrived(op)
        self._put(op.key, buf)

    # -- the tensor table --------------------------------------------------------------------
    def _needs(self, a: Action) -> list[str]:
        """The table keys action `a` reads (each handler reads exactly these, via _take): its
        dataflow needs that are tensors arriving from another action (not ordering events)."""
        return [k for k in self.flow.needs(a) if TensorKey.parse(k).is_transfer]

    def _put(self, key: str, tensor: torch.Tensor) -> None:
        """Keep `tensor` for its local readers and sends (a key with neither is not kept)."""
        if self._uses_left[key] > 0 or self._sends_left[key] > 0:
            self.tensors[key] = tensor

    def _take(self, key: str) -> torch.Tensor:
        """A local reader's `key`; the last reader (with no send left) removes it."""
        tensor = self.tensors[key]
        self._uses_left[key] -= 1
        self._release(key)
        return tensor

    def _release(self, key: str) -> None:
        if self._uses_left[key] <= 0 and self._sends_left[key] <= 0:
            self.tensors.pop(key, None)

    # -- fills -------------------------------------------------------------------------------
    def _run_overlapped(self, op: Op) -> None:
        """The action with its fills paced over its TP collectives: the plan's bubble indices
        stretched over the collectives it issues (counted on its first run this step; until then
        one per planned bubble)."""
        from megatron_mllm_patches.async_tp_collectives import filling

        a = op.action
        kind = (a.kind, a.stage, a.chunk)
        planned = self._planned.get(kind, 1)
        budgets = fill_budgets(op.fills, self._collectives.get(kind, planned), planned)
        pacer = FillPacer(op.fills, budgets, self._fill)
        encoders = [s for k, s in self.grad_sync.items() if part_encoder(k) is not None]
        with reductions_held(encoders), filling(pacer):
            self._run(a)
        self._collectives.setdefault(kind, len(pacer.ran))
        self.result.fills_per_wait += pacer.ran
        for rest in pacer.queue:
            self._run(rest)

    def _fill(self, action: Action, kind: str) -> None:
        """One fill inside a `kind` collective."""
        start = self.clock.mark()
        # A wait inside the backbone's backward runs under autograd's no-grad mode; an encoder
        # forward fill still builds its graph (and a backward fill re-enters).
        with torch.set_grad_enabled(not self.forward_only):
            self._run(action)
        self._fill_marks.append((start, self.clock.mark()))
        self.result.overlapped += 1
        inside = self.result.overlapped_in
        inside[kind] = inside.get(kind, 0) + 1

    def _fill_wait(self, work, i: int, done: list[bool]) -> None:
        """Dynamic mode: while a message is on its way, run later encoder work that is ready,
        with at most `max_encoder_ahead` encoder micro-batches ahead of the program at once."""
        for key in [k for k, j in self._ahead.items() if j <= i]:
            del self._ahead[key]  # the program has caught up with it
        while not work.is_completed():
            j = self._next_movable(i, done)
            if j is None:
                return  # nothing ready (or the budget is full): block on the message
            a = self.program[j].action
            self._run(a)
            done[j] = True
            self.result.moved += 1
            if a.kind == "EF":
                self._ahead[(a.enc, a.mb)] = max(j, self._ahead.get((a.enc, a.mb), j))
                most = max(self.result.max_encoder_ahead, len(self._ahead))
                self.result.max_encoder_ahead = most

    def _next_movable(self, i: int, done: list[bool]) -> int | None:
        """The first later stand-alone encoder chunk that is ready and within the budget."""
        for j in range(i + 1, len(self.program)):
            op = self.program[j]
            if done[j] or op.kind != "run" or op.fills or op.action.kind not in ("EF", "EB"):
                continue
            a = op.action
            full = len(self._ahead) >= self.max_encoder_ahead
            if a.kind == "EF" and full and (a.enc, a.mb) not in self._ahead:
                continue  # a new micro-batch's activations would exceed the budget
            if a.kind == "EF" and a.k0 == 0 and len(self.enc_units) >= self.encoder_live_budget:
                continue  # more encoder activations than the plan holds at its peak
            if self._ready(a):
                return j
        return None

    def _ready(self, a: Action) -> bool:
        """Whether an encoder chunk's inputs are already on this GPU."""
        enc = self.meta.encoders[a.enc]
        units = self.enc_units.get((a.enc, a.stage, a.mb), [])
        if a.kind == "EF" and a.k0 > 0:
            return len(units) == a.k0
        if a.kind == "EB" and (
            len(units) != enc.fwd_kernels[a.stage]
            or self._bwd_done.get((a.enc, a.stage, a.mb), 0) != a.k0
        ):
            return False
        return all(k in self.tensors for k in self._needs(a))

    # -- timing ------------------------------------------------------------------------------
    def _time(self, model: str, direction: str, name: str, seconds: float) -> None:
        self.result.unit_times.setdefault((model, direction, name), []).append(seconds)

    def _time_later(self, model: str, direction: str, name: str, a, b) -> None:
        """A unit time from marks `a` to `b`, read at step end."""
        self._later.append(lambda: self._time(model, direction, name, self.clock.between(a, b)))

    def _span_later(self, stream: str, action: Action, category: str, a, b) -> None:
        """A trace span from marks `a` to `b`, read at step end."""

        def read() -> None:
            start, end = self.clock.since_start(a), self.clock.since_start(b)
            self.result.spans.append(
                Span(self.rank, None, stream, action, "", start, end, category)
            )

        self._later.append(read)

    def _observer(self, action: Action, blocked: list) -> Callable:
        """The TP collective observer of one backbone action: every wait's marks count as
        blocked time; a wait without fills is also a clean sample of the collective."""
        suffix = "" if action.kind == "F" else "_b"

        def observe(kind: str, a, b, filled: bool) -> None:
            blocked.append((a, b))
            if not filled:
                self._time_later("llm", "collectives", kind + suffix, a, b)

        return observe

    def _backbone_time_later(self, action: Action, a, b, inside: list) -> None:
        """Per-layer compute time of a backbone action: its span without the fills and the
        collective waits `inside` it (those are measured separately); a split backward's B
        and W count as one backward."""
        layers = len(self.chunks[action.chunk].gpt.decoder.layers)
        forward = action.kind == "F"
        parts = [(a, b, inside)]
        if not forward and self.meta.splits_backbone(action):
            key = (action.stage, action.chunk, action.mb)
            if action.kind == "B":
                self._bb_input_grad[key] = parts[0]
                return
            parts.append(self._bb_input_grad.pop(key))

        def read() -> None:
            own = sum(
                self.clock.between(x0, x1) - self._covered(cut, x0, x1) for x0, x1, cut in parts
            )
            name = "layer" if forward else "layer_b"
            self._time("llm", "forward" if forward else "backward", name, own / layers)

        self._later.append(read)

    def _head_spans(self, others: list[tuple]) -> list[tuple]:
        """The head's spans inside the action that just ran (none off the last stage), each
        timed as the job's "head" / "head_b" unit without the fills and TP waits in `others`
        that fall inside it (those are measured apart)."""
        if self.head_timer is None:
            return []
        spans = self.head_timer.take()
        for direction, a, b, timed in spans:
            if timed:
                self._head_time_later(direction, a, b, others)
        return [(a, b) for _, a, b, _ in spans]

    def _head_time_later(self, direction: str, a, b, others: list[tuple]) -> None:
        """The head's own seconds from `a` to `b`, less what of `others` lies inside."""
        name = "head" if direction == "forward" else "head_b"

        def read() -> None:
            self._time(
                "llm", direction, name, self.clock.between(a, b) - self._covered(others, a, b)
            )

        self._later.append(read)

    def _covered(self, spans: list[tuple], a, b) -> float:
        """Seconds of [a, b] that the union of mark pairs `spans` covers (after the clock's
        finish: fills, TP waits and head spans may nest or overlap)."""
        at = self.clock.since_start
        total, reached, hi = 0.0, at(a), at(b)
        for x, y in sorted((at(x), at(y)) for x, y in spans):
            x, y = max(x, reached), min(y, hi)
            if y > x:
                total, reached = total + y - x, y
        return total

    def _gathered(self, action: Action) -> None:
        """Before a part's forward: its parameters gathered (overlapped AG); the wait, if
        any, is a DP span (the gather's unhidden part)."""
        part = "bb" if action.kind == "F" else part_name(action.enc)
        sync = self.grad_sync.get(part)
        if sync is None or not sync.stale:
            return
        start = self.clock.mark()
        sync.finish_gather()
        self._span_later("dp", Action("AG", key=part), "dp", start, self.clock.mark())

    def _run(self, action: Action) -> None:
        if action.kind in ("F", "EF"):
            self._gathered(action)
        start, first_fill = self.clock.mark(), len(self._fill_marks)
        backbone = action.kind in ("F", "B", "W")
        ahead = action.kind in ("F", "EF") and not self.meta.trains(action.mb)  # no graph
        with torch.no_grad() if ahead else contextlib.nullcontext():
            if backbone:
                from megatron_mllm_patches.async_tp_collectives import observing

                blocked: list[tuple] = []
                with observing(self._observer(action, blocked), mark=self.clock.mark):
                    self.handlers[action.kind](action)
            else:
                self.handlers[action.kind](action)
        end = self.clock.mark()
        if backbone:
            others = self._fill_marks[first_fill:] + blocked
            cut = others + self._head_spans(others)
            if not ahead:  # unit times are training units (a look-ahead forward has no graph)
                self._backbone_time_later(action, start, end, cut)
            for a, b in blocked:  # the TP collectives' waits inside it (fills may hide them)
                self._span_later("comm", action, "tp", a, b)
        category = "backbone" if backbone else "encoder" if action.kind in ENCODER_KINDS else "dp"
        self._span_later("dp" if category == "dp" else "compute", action, category, start, end)

    # -- inputs ------------------------------------------------------------------------------
    def _shape(self, key: str) -> tuple[int, ...]:
        """The shape of a message's tensor, from its key."""
        cfg, b, k = self.cfg, self.micro_batch, TensorKey.parse(key)
        if k.kind in ("act", "grad"):  # [s/tp, b, h] with sequence parallelism
            config = self.backbone.gpt.config
            split = config.tensor_model_parallel_size if config.sequence_parallel else 1
            return (cfg.seq_len // split, b, cfg.llm_hidden)
        enc = cfg.encoder_config(k.enc)
        batch = self._batch(k.mb)
        if batch.native:  # one sequence of every image's patches (or merged windows)
            patches = batch.images.shape[0]
            if k.kind in ("eout", "egrad"):
                return (patches // batch.merge**2, 1, cfg.llm_hidden)
            return (patches, 1, enc.vit_hidden)
        images = batch.num_images  # encoder messages carry the micro-batch's images
        if k.kind in ("eout", "egrad"):
            return (enc.num_patches, images, cfg.llm_hidden)
        return (enc.encoder_seq_len, images, enc.vit_hidden)

    def _batch(self, mb: int) -> MicroBatch:
        if mb not in self._batches:
            self._batches[mb] = self.data(mb).to(self.device, self.dtype)
        return self._batches[mb]

    def _move_batches(self) -> None:
        """Every micro-batch the program touches, on the device from the step's start: a
        GPU copies them from pinned host memory without blocking the host, so no copy waits
        mid-step behind queued kernels (`MicroBatch.to`). Under look-ahead only the pool's:
        the step's own are copied when first used (their rows may arrive after the start)."""
        fills = {fill.mb for op in self.program for fill in op.fills}
        own = self.meta.num_microbatches if self.meta.lookahead else 0
        for mb in sorted(({op.mb for op in self.program} | fills) - {None}):
            if mb >= own:  # look-ahead: the step's own rows may still be on their way
                self._batch(mb)

    # -- data parallel ---------------------------------------------------------------------
    def _all_gather(self, a: Action) -> None:
        """The part's DP parameter all-gather: with --overlap-param-gather started here (the
        part's first forward waits for it); otherwise the optimizer step gathered already
        (or, without the distributed optimizer, parameters are replicated)."""
        sync = self.grad_sync.get(a.key)
        if sync is not None:
            sync.start_gather()

    def _reduce_scatter(self, a: Action) -> None:
        """The part's DP gradient reduction (megatron-core DDP, data_parallel.py): with overlap
        its buckets are in flight by now; it is finished at step end, part by part in one
        order on every rank. A part this rank does not hold has nothing to reduce."""
        sync = self.grad_sync.get(a.key)
        if sync is not None:
            sync.mark()
