"""The micro-batches of each training step, the same for every run mode: synthetic (indexed by
step, replica and micro-batch) or streamed from a LLaVA-format energon dataset (one stream per
DP replica the process runs, its position saved in checkpoints)."""

from __future__ import annotations

import functools
from collections.abc import Callable

from megatron_mllm.data.batch import MicroBatch, image_then_text


def batches(job, step: int) -> Callable[..., MicroBatch]:
    """Synthetic data: `get(mb, dp=0)`, micro-batch `mb` of step `step` for DP replica `dp`.
    Tensors are on the CPU; each run mode moves them to its device."""
    from megatron_mllm.data.synthetic import microbatch, native_microbatch

    b, n_mb, dp_size = job.micro_batch, job.num_microbatches, job.backbone.dp

    def synthetic(mb: int, dp: int = 0) -> MicroBatch:
        index = (step * dp_size + dp) * n_mb + mb
        if job.cfg.vit_native:  # images of their own sizes
            return native_microbatch(job.cfg, index, b, job.data.seed)
        images, text = microbatch(job.cfg, index, b, job.data.seed)
        return image_then_text(images, text, job.cfg.image_tokens)

    return synthetic


def encoder_load(batch: MicroBatch, cfg, times: dict | None = None) -> float:
    """A micro-batch's encoder work in the plan's units, what optimus-adaptive plans a step
    from: its image count, or for a native-resolution tower its nominal images (each row's
    images weighed by their cost at their own sizes, `schedule.patch_loads`, as the tower's
    profile in the measured `times` has it where there is one)."""
    if not batch.native:
        return batch.num_images
    side, shape = cfg.image_size // cfg.patch_size, tower_cost(cfg, times)
    return shape.microbatch_cost(batch.row_grids()) / shape.nominal_cost((side, side))


def tower_cost(cfg, times: dict | None = None):
    """The native tower's `TowerShape`, profiled where the measured unit `times` carry the
    tower's seconds by patch count (`profile_units`)."""
    points = ((times or {}).get("vit") or {}).get("tower") or ()
    return _tower_cost(cfg, tuple((int(n), s) for n, s in points))


@functools.lru_cache(maxsize=8)
def _tower_cost(cfg, points: tuple[tuple[int, float], ...]):
    """`tower_cost`, made once per config and profile (it is asked per micro-batch)."""
    from megatron_mllm.schedule.patch_loads import profiled

    if not points:
        return cfg.tower_shape()
    side = cfg.image_size // cfg.patch_size
    return profiled(cfg.tower_shape(), (side, side), dict(points))


def pool_batches(job, step: int) -> Callable[..., MicroBatch]:
    """Synthetic coreset pools: `get(mb, dp=0)`, micro-batch `mb` of replica `dp`'s pool of
    r x B individually indexed samples at step `step`, each with its class as source id."""
    from dataclasses import replace

    from megatron_mllm.data.synthetic import samples

    size, b = job.data.coreset.pool_size, job.micro_batch

    def pool(mb: int, dp: int = 0) -> MicroBatch:
        start = (step * job.backbone.dp + dp) * size + mb * b
        images, text, source = samples(job.cfg, list(range(start, start + b)), job.data.seed)
        batch = image_then_text(images, text, job.cfg.image_tokens)
        return replace(batch, sources=tuple(source.tolist()))

    return pool


class StepData:
    """The micro-batches of DP replicas `replicas`, step after step (`step(i)` once per step, in
    order). Every rank of a replica reads the same stream, so all of them know each
    micro-batch's image count. With `DataParts.balance_samples` a training step's samples are
    dealt into micro-batches of equal encoder loads across every DP replica (not a coreset
    pool; runtime/inputs/sample_exchange.py): over the replicas held here when they are all of them,
    else exchanging samples over `exchange`, set by the caller."""

    def __init__(self, job, replicas: list[int], split: str = "train") -> None:
        self.job, self.replicas = job, replicas
        self.balance = job.data.balance_samples and split == "train"
        self.exchange = None  # the gloo group samples are dealt over (one replica a process)
        self.streams = {}
        llava = job.data.llava
        if llava is not None:
            from megatron_mllm.data.llava_source import LlavaStream

            cfg = job.cfg
            self.streams = {
                dp: LlavaStream(
                    llava,
                    split,
                    dp,
                    job.backbone.dp,
                    job.micro_batch,
                    cfg.image_tokens,
                    cfg.image_size,
                    job.data.seed,
                    native=cfg.native_image_spec() if cfg.vit_native else None,
                )
                for dp in replicas
            }
        # One step read ahead (optimus-adaptive plans it from its image counts): that step and
        # every stream's state before it, which checkpoints taken meanwhile save.
        self._ahead: tuple[int, Callable[..., MicroBatch], dict] | None = None

    def step(self, step: int, num_microbatches: int | None = None) -> Callable[..., MicroBatch]:
        """`get(mb, dp)` for this step's micro-batches (read from the streams now, unless
        `prefetch` read them already)."""
        if self._ahead is not None and self._ahead[0] == step:
            get, self._ahead = self._ahead[1], None
            return get
        if not self.streams:
            return batches(self.job, step)
        n = num_microbatches or self.job.num_microbatches
        taken = {dp: stream.take(n) for dp, stream in self.streams.items()}
        if self.balance and num_microbatches is None:
            taken = self._dealt(taken)

        def get(mb: int, dp: int = 0) -> MicroBatch:
            return taken[dp][mb]

        return get

    def _load(self, sample: MicroBatch) -> float:
        """A one-row micro-batch's encoder load (what dealing balances)."""
        return encoder_load(sample, self.job.cfg, self.job.executor.plan_times)

    def _dealt(self, taken: dict[int, list[MicroBatch]]) -> dict[int, list[MicroBatch]]:
        """The step's samples dealt by encoder load over every replica (see the class
        docstring)."""
        from megatron_mllm.runtime.inputs import sample_exchange

        if self.exchange is not None:
            return {
                dp: sample_exchange.deal_across(b, self.exchange, self._load)
                for dp, b in taken.items()
            }
        if len(taken) != self.job.backbone.dp:
            raise RuntimeError("dealing samples needs every replica here, or an exchange group")
        order = sorted(taken)
        dealt = sample_exchange.deal_locally([taken[dp] for dp in order], self._load)
        return dict(zip(order, dealt, strict=True))

    def pool(self, step: int) -> Callable[..., MicroBatch]:
        """Coreset: `get(mb, dp)` for `step`'s pool of r x B samples per replica (source ids
        included), in micro-batches of the job's size."""
        if not self.streams:
            return pool_batches(self.job, step)
        return self.step(step, self.job.data.coreset.pool_size // self.job.micro_batch)

    def _read_ahead(self, step: int, read: Callable) -> Callable[..., MicroBatch]:
        """`read(step)` now, one step ahead; checkpoints until `step` runs save the streams'
        position before it (a resumed run reads it again)."""
        before = {dp: s.state() for dp, s in self.streams.items()}
        get = read(step)
        self._ahead = (step, get, before)
        return get

    def prefetch_pool(self, step: int) -> Callable[..., MicroBatch]:
        """Coreset look-ahead: `step`'s pool, read one step ahead."""
        return self._read_ahead(step, self.pool)

    def prefetch(self, step: int) -> list[list[float]]:
        """Read `step`'s micro-batches now, one step ahead; each replica's encoder load per
        micro-batch (`encoder_load`)."""
        get = self._read_ahead(step, self.step)
        n, cfg, times = self.job.num_microbatches, self.job.cfg, self.job.executor.plan_times
        return [[encoder_load(get(m, dp), cfg, times) for m in range(n)] for dp in self.replicas]

    def cut(self) -> tuple[int, int, int, int]:
        """Samples cut to the sequence length so far, those of them left without an answer
        token, samples skipped as corrupted, and samples read (packed rows hold several),
        over this process's replicas (not counting a step read ahead)."""
        if self._ahead is not None and self._ahead[2]:
            states = list(self._ahead[2].values())
        else:
            states = [
                {
                    "truncated": s.truncated,
                    "no_answer": s.no_answer,
                    "corrupted": s.corrupted,
                    "samples": s.samples,
                }
                for s in self.streams.values()
            ]
        return (
            sum(state["truncated"] for state in states),
            sum(state.get("no_answer", 0) for state in states),
            sum(state.get("corrupted", 0) for state in states),
            sum(state.get("samples", 0) for state in states),
        )

    def state(self, dp: int) -> dict | None:
        """Replica `dp`'s stream position for a checkpoint (None for synthetic data): after
        the last step that ran, a step read ahead not counted."""
        if not self.streams:
            return None
        if self._ahead is not None:
            return self._ahead[2][dp]
        return self.streams[dp].state()

    def restore(self, dp: int, state: dict | None) -> None:
        if self.streams and state is not None:
            self.streams[dp].restore(state)

    def close(self) -> None:
        for stream in self.streams.values():
            stream.close()
