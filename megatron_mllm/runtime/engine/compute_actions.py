"""The executor's compute handlers (DeepSpeed's instruction -> handler map, by action kind):
backbone forward and backward (F, B) on megatron-core's GPT chunks, encoder units forward and
backward (EF, EB) one unit at a time, and the encoder-memory budget dynamic mode keeps within.

`ComputeActions` is the half of `Executor` that touches the modules; the interpreter half
(`executor.py`: the program loop, messages, fills, timing) owns the state it reads: the tensor
table (`_put`, `_take`, `_needs`), the step's batches, the clock and the modules.
"""

from __future__ import annotations

import contextlib

import torch

from megatron_mllm.runtime.engine.program import Op
from megatron_mllm.schedule.actions import Action
from megatron_mllm.schedule.keys import TensorKey, part_name
from megatron_mllm.schedule.schedule import ScheduleMeta


class ComputeActions:
    """Handlers of F, B, W, EF, EB and EW for `Executor` (which sets every attribute they read)."""

    # -- backbone --------------------------------------------------------------------------
    def _forward(self, a: Action) -> None:
        meta = self.meta
        v = meta.virtual_index(a.stage, a.chunk)
        last = v == meta.num_virtual_stages - 1
        trains = self._trains(a.mb)
        # The encoders' outputs (first virtual stage) or the previous stage's activation.
        inputs = [self._take(k).detach().requires_grad_(trains) for k in self._needs(a)]
        pool = last and self._is_pool(a.mb)
        self._capture_next = pool
        with self._backbone_deferring(a):
            if v == 0:
                first = self.chunks[a.chunk]
                batch = self._batch(a.mb)
                out = first(None, first.decoder_input(inputs, batch), batch)
            else:
                out = self.chunks[a.chunk](inputs[0], batch=self._batch(a.mb))
        self._capture_next = False
        if pool:  # a coreset pool's micro-batch: the selection reads the output layer's input
            self.last_layer_inputs[a.mb] = self._captured.pop()
            self._head_done(timed=False)  # no loss: its head is not the unit's
        elif last:
            if self.evaluate:
                self._matches[a.mb] = self.backbone.exact_matches(out, self._batch(a.mb))
            summed = self.loss_norm is not None and not self.evaluate
            out = self.backbone.loss(out, self._batch(a.mb), summed=summed)
            self._losses[a.mb] = out.detach()  # read at step end, after the one synchronize
            self._head_done(timed=True)
        else:
            s, c = meta.stage_chunk(v + 1)
            self._put(str(TensorKey.act(s, c, a.mb)), out.detach())
        if trains:  # a forward-only pass has no backward to keep it for
            self.bb_ctx[(a.stage, a.chunk, a.mb)] = (inputs, out)

    def _head_done(self, timed: bool) -> None:
        """The last stage's head forward ends here (its span cut from the layers' time; a
        sample of the head's unit where `timed`)."""
        if self.head_timer is not None:
            self.head_timer.forward_done(timed)

    def _backward(self, a: Action) -> None:
        meta = self.meta
        v = meta.virtual_index(a.stage, a.chunk)
        inputs, out = self.bb_ctx.pop((a.stage, a.chunk, a.mb))
        with self.bb_weight_grads.unit(_unit(a)) if self._split(a) else contextlib.nullcontext():
            if v == meta.num_virtual_stages - 1:
                norm = self.loss_norm
                loss = out / meta.num_microbatches if norm is None else out * norm
                # A split backward leaves the output layer's weight gradient to its W (counted
                # with the layers'): its head is not timed apart.
                timer = None if self._split(a) else self.head_timer
                with timer.backward() if timer is not None else contextlib.nullcontext():
                    (loss * self.loss_scale if self.loss_scale is not None else loss).backward()
            else:
                out.backward(self._take(self._needs(a)[0]))
        if v > 0:
            s, c = meta.stage_chunk(v - 1)
            self._put(str(TensorKey.grad(s, c, a.mb)), inputs[0].grad)
        else:
            for e, x in enumerate(inputs):
                if meta.encoders[e].trainable:
                    self._put(str(TensorKey.egrad(e, a.mb)), x.grad)

    def _backbone_wgrad(self, a: Action) -> None:
        """A split backbone backward's weight gradients (its B deferred them)."""
        self.result.deferred_products += self.bb_weight_grads.apply(_unit(a))

    def _backbone_deferring(self, a: Action):
        """Around a backbone forward whose backward is split: its linears defer their weight
        gradients to W."""
        if self._split(a) and self._trains(a.mb):
            return self.bb_weight_grads.deferring()
        return contextlib.nullcontext()

    def _split(self, a: Action) -> bool:
        """Whether backbone action `a`'s backward is split in this pass (a training one)."""
        return self.bb_weight_grads is not None and self.meta.splits_backbone(a)

    # -- encoder ---------------------------------------------------------------------------
    def _encoder_forward(self, a: Action) -> None:
        """Units k0..k1 of an encoder stage; each keeps its input leaves and output state, so
        its backward can run on its own (see EncoderStage's units)."""
        enc_meta = self.meta.encoders[a.enc]
        units = self.enc_units.setdefault((a.enc, a.stage, a.mb), [])
        live = max(self.result.max_encoder_live, len(self.enc_units))
        self.result.max_encoder_live = live
        if a.k0 == 0:
            needs = self._needs(a)
            state = (self._take(needs[0]) if needs else self._batch(a.mb).images,)
        if self._batch(a.mb).num_images == 0:  # text only: the encoder has nothing to do
            self._pass_empty(a, enc_meta.fwd_kernels[a.stage], forward=True)
            return
        if a.k0 > 0:
            state = units[-1][1]
        encoder, model = self.encoders[a.enc], self.cfg.encoder_name(a.enc)
        if self._batch(a.mb).native:  # its images' masks and rotary angles, for these units
            encoder.prepare(self._batch(a.mb).grids)
        names, t_unit = encoder.unit_names(), self.clock.mark()
        split = enc_meta.wgt(a.stage) > 0 and self._trains(a.mb)  # weight gradients in EW
        timed = self.meta.trains(a.mb)  # unit times are training units (a look-ahead's: no graph)
        for u in range(a.k0, a.k1):
            if encoder.unit_trainable(u):
                upstream = self._wants_input_grad(a, u)
                leaves = tuple(t.detach().requires_grad_(upstream) for t in state)
                with self.weight_grads.deferring() if split else contextlib.nullcontext():
                    out = encoder.run_unit(u, leaves)
            else:  # frozen: no graph, and nothing upstream of it wants a gradient
                leaves = tuple(t.detach() for t in state)
                with torch.no_grad():
                    out = encoder.run_unit(u, leaves)
            units.append((leaves, out))
            state = out
            t_end = self.clock.mark()
            if timed:
                self._time_later(model, "forward", names[u], t_unit, t_end)
            t_unit = t_end
        if a.k1 == enc_meta.fwd_kernels[a.stage]:
            last = a.stage == enc_meta.num_stages - 1
            nxt = TensorKey.eout(a.enc, a.mb) if last else TensorKey.eact(a.enc, a.stage + 1, a.mb)
            (out,) = (t.detach() for t in state)
            self._put(str(nxt), out)
            if not self._encoder_backward_follows(a):
                del self.enc_units[(a.enc, a.stage, a.mb)]  # no backward will read its units

    def _trains(self, mb: int) -> bool:
        """Whether micro-batch `mb` runs backward in this pass."""
        return self.meta.trains(mb) and not self.forward_only

    def _is_pool(self, mb: int) -> bool:
        """Whether micro-batch `mb` is a coreset pool's (a pool pass, or a look-ahead one)."""
        return not self.evaluate and not self._trains(mb)

    def _encoder_backward_follows(self, a: Action) -> bool:
        """Whether an encoder stage's forward of `a`'s micro-batch is read by a backward."""
        return self.meta.encoders[a.enc].bwd_kernels[a.stage] > 0 and self._trains(a.mb)

    def _wants_input_grad(self, a: Action, u: int) -> bool:
        """Whether unit u's input needs a gradient: something before it trains. In a frozen
        encoder only the projector trains, so the input of its second half (proj_fc2) needs
        one (for proj_fc1's parameters), the first trained unit's input does not."""
        if a.stage == 0 and u == 0:
            return False
        if not self.encoder_frozen[a.enc]:
            return True
        encoder = self.encoders[a.enc]
        return any(encoder.unit_trainable(v) for v in range(u))

    def _pass_empty(self, a: Action, total: int, forward: bool) -> None:
        """A micro-batch without images: no encoder unit runs; the stage's message (of zero
        images) still goes where the schedule sends it, so every peer's program is unchanged."""
        enc_meta, key = self.meta.encoders[a.enc], (a.enc, a.stage, a.mb)
        if not forward:
            if a.k0 == 0:
                self._take(self._needs(a)[0])
            self._bwd_done[key] = a.k1
            sync = self.grad_sync.get(part_name(a.enc))
            if sync is not None and a.k1 == total:  # each parameter's hook fires once per mb
                sync.no_gradient(p for p in self.encoders[a.enc].parameters() if p.requires_grad)
        if a.k1 < total:
            return
        if forward:
            last = a.stage == enc_meta.num_stages - 1
            nxt = TensorKey.eout(a.enc, a.mb) if last else TensorKey.eact(a.enc, a.stage + 1, a.mb)
        elif a.stage > 0 and enc_meta.bwd_kernels[a.stage - 1] > 0:
            nxt = TensorKey.egin(a.enc, a.stage - 1, a.mb)
        else:
            nxt = None
        if nxt is not None:
            shape = self._shape(str(nxt))
            self._put(str(nxt), torch.empty(shape, dtype=self.dtype, device=self.device))
        if not forward or not self._encoder_backward_follows(a):
            self.enc_units.pop(key, None)

    def _encoder_backward(self, a: Action) -> None:
        enc_meta = self.meta.encoders[a.enc]
        if self._batch(a.mb).num_images == 0:
            self._pass_empty(a, enc_meta.bwd_kernels[a.stage], forward=False)
            return
        units = self.enc_units[(a.enc, a.stage, a.mb)]
        total, split = enc_meta.fwd_kernels[a.stage], enc_meta.wgt(a.stage) > 0
        names, model = self.encoders[a.enc].unit_names(), self.cfg.encoder_name(a.enc)
        for b in range(a.k0, a.k1):
            t_unit = self.clock.mark()
            u = total - 1 - b
            if b == 0:
                grads = (self._take(self._needs(a)[0]),)
            else:
                grads = tuple(leaf.grad for leaf in units[u + 1][0])
            outs = [(y, g) for y, g in zip(units[u][1], grads, strict=True) if g is not None]
            key = (a.enc, a.stage, a.mb, u)
            with self.weight_grads.unit(key) if split else contextlib.nullcontext():
                torch.autograd.backward([y for y, _ in outs], [g for _, g in outs])
            self._bwd_done[(a.enc, a.stage, a.mb)] = b + 1
            if split:  # the unit's time is measured whole: this and its EW part
                self._input_grad_marks[key] = (t_unit, self.clock.mark())
            else:
                self._time_later(model, "backward", names[u] + "_b", t_unit, self.clock.mark())
        if a.k1 == enc_meta.bwd_kernels[a.stage]:
            if a.stage > 0 and enc_meta.bwd_kernels[a.stage - 1] > 0:
                self._put(str(TensorKey.egin(a.enc, a.stage - 1, a.mb)), units[0][0][0].grad)
            del self.enc_units[(a.enc, a.stage, a.mb)]

    def _encoder_wgrad(self, a: Action) -> None:
        """Weight-gradient kernels k0..k1 of a split encoder stage's backward: its units' deferred
        weight products, in backward order, the stage's units spread evenly over its kernels."""
        enc_meta = self.meta.encoders[a.enc]
        if self._batch(a.mb).num_images == 0:
            return  # its EB told DDP already that no gradient comes (`_pass_empty`)
        total, kernels = enc_meta.fwd_kernels[a.stage], enc_meta.wgt(a.stage)
        names, model = self.encoders[a.enc].unit_names(), self.cfg.encoder_name(a.enc)
        for b in range(a.k0 * total // kernels, a.k1 * total // kernels):
            u, start = total - 1 - b, self.clock.mark()
            key = (a.enc, a.stage, a.mb, u)
            self.result.deferred_products += self.weight_grads.apply(key)
            parts = (self._input_grad_marks.pop(key), (start, self.clock.mark()))
            self._whole_backward_later(model, names[u] + "_b", *parts)

    def _whole_backward_later(self, model: str, name: str, *parts: tuple) -> None:
        """A unit's backward time as the sum of its split parts' marks, read at step end."""

        def read() -> None:
            self._time(model, "backward", name, sum(self.clock.between(a, b) for a, b in parts))

        self._later.append(read)


def planned_encoder_live(program: list[Op], meta: ScheduleMeta) -> int:
    """The most encoder (encoder, stage, micro-batch) activations `program` holds at once, run
    in its own order: from a stage's first forward unit to its last backward unit (or to its
    last forward unit when nothing runs backward). The planner's memory estimate is for this
    order, so dynamic mode keeps within it."""
    live: set[tuple[int, int, int]] = set()
    peak = 0
    for op in program:
        for a in (*op.fills, op.action) if op.kind == "run" else ():
            if a.kind not in ("EF", "EB"):
                continue
            enc, key = meta.encoders[a.enc], (a.enc, a.stage, a.mb)
            if a.kind == "EF" and a.k0 == 0:
                live.add(key)
                peak = max(peak, len(live))
            last_fwd = a.kind == "EF" and a.k1 == enc.fwd_kernels[a.stage]
            no_backward = enc.bwd_kernels[a.stage] == 0 or not meta.trains(a.mb)
            if (a.kind == "EB" and a.k1 == enc.bwd_kernels[a.stage]) or (last_fwd and no_backward):
                live.discard(key)
    return max(peak, 1)


def _unit(a: Action) -> tuple:
    """A split backbone backward's key among the deferred weight products."""
    return ("bb", a.stage, a.chunk, a.mb)
