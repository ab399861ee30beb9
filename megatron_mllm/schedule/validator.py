"""The one validator: every dependency, send/recv pairing, complete counts, no deadlock.

`validate(schedule)` raises `ScheduleError` naming the rank, the step and the rule broken, with
the action grid around that step.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from megatron_mllm.errors import ConfigError
from megatron_mllm.schedule.actions import ENCODER_KINDS, Action
from megatron_mllm.schedule.dataflow import RULES, Dataflow, dataflow_of
from megatron_mllm.schedule.keys import TensorKey, part_name
from megatron_mllm.schedule.schedule import Schedule


class ScheduleError(ConfigError):
    """An invalid schedule. The first line of the message says rank, step and rule."""

    def __init__(self, schedule: Schedule, rank: int, step: int, rule: str, detail: str) -> None:
        self.rank, self.step, self.rule = rank, step, rule
        action = schedule.ranks[rank][step] if 0 <= step < len(schedule.ranks[rank]) else None
        at = f" at {action}" if action is not None else ""
        self.summary = f"invalid schedule: rank {rank}, step {step}{at}: [{rule}] {detail}"
        grid = schedule.grid(center=step, mark=(rank, step))
        super().__init__(f"{self.summary}\n{grid}")


def backbone_groups(actions: list[Action]) -> list[list[int]]:
    """Steps grouped for execution: TP-bubble fills travel with the backbone action after them."""
    groups, pending = [], []
    for i, a in enumerate(actions):
        if a.fill is not None:
            pending.append(i)
            continue
        groups.append(pending + [i])
        pending = []
    if pending:
        groups.append(pending)
    return groups


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError at the first rule the schedule breaks; return None if it is valid."""
    meta = schedule.meta
    flow = dataflow_of(meta, schedule.encoder_assignment())

    def fail(rank: int, step: int, rule: str, detail: str):
        raise ScheduleError(schedule, rank, step, rule, detail)

    if len(schedule.ranks) != meta.pp:
        raise ConfigError(f"invalid schedule: {len(schedule.ranks)} ranks but PP={meta.pp}")
    layers = meta.backbone_layers
    if layers and (len(layers) != meta.pp * meta.vpp or min(layers) < 1):
        raise ConfigError(
            f"invalid schedule: backbone_layers {list(layers)} must give each of the "
            f"{meta.pp * meta.vpp} virtual stages (PP {meta.pp} x VPP {meta.vpp}) a layer or more"
        )

    # Each action belongs on one rank, once.
    seen: dict[tuple, tuple[int, int]] = {}
    for r, actions in enumerate(schedule.ranks):
        for i, a in enumerate(actions):
            prev = actions[i - 1] if i > 0 else None
            if prev is not None and prev.fill is not None:
                if a.fill is None and a.kind not in ("F", "B"):
                    fail(r, i, "fill", "a TP-bubble fill must be followed by a backbone F or B")
                if a.fill is not None and a.fill < prev.fill:
                    fail(
                        r,
                        i,
                        "fill",
                        f"fills of one action go in bubble order; @tp{a.fill} after @tp{prev.fill}",
                    )
            home = flow.home_rank(a)
            if home is None:
                fail(
                    r,
                    i,
                    "unknown",
                    f"{a} names a stage, micro-batch, encoder or pipeline "
                    "that this schedule does not have",
                )
            if a.kind in ("SEND", "RECV"):
                producer, consumer = flow.transfer_ranks(a.key)
                if producer == consumer:
                    fail(
                        r,
                        i,
                        "local-transfer",
                        f"{a.key} is made and used on rank {producer}; drop the SEND/RECV pair",
                    )
            if a.kind in ("B", "W", "EB", "EW") and not meta.trains(a.mb):
                fail(r, i, "lookahead", f"micro-batch {a.mb} is a look-ahead one: forward only")
            if a.kind == "W" and not meta.splits_backbone(a):
                fail(r, i, "split", f"{a}: its backward is not split (no backbone_wgrad entry)")
            if a.kind in ENCODER_KINDS and not meta.has_images(a.mb):
                fail(r, i, "text-only", f"micro-batch {a.mb} has no image: no encoder work")
            if home != -1 and home != r:
                fail(r, i, "wrong-rank", f"{a} belongs on rank {home}")
            if a.fill is not None and a.kind not in ENCODER_KINDS:
                fail(r, i, "fill", "only encoder work can fill a TP bubble")
            if a.fill is not None and i == len(actions) - 1:
                fail(r, i, "fill", "a TP-bubble fill must be followed by a backbone F or B")
            if a.kind in ("AG", "RS"):
                continue  # one per rank; counted in _check_counts
            same = (a.kind, a.stage, a.chunk, a.mb, a.enc, a.pipe, a.k0, a.k1, a.key)  # any fill
            if same in seen:
                fail(
                    r, i, "duplicate", f"{a} already at rank {seen[same][0]}, step {seen[same][1]}"
                )
            seen[same] = (r, i)

    _check_counts(schedule, flow, fail)
    _check_pairs(schedule, fail)
    _check_dataflow(schedule, flow, fail)


def _check_counts(schedule: Schedule, flow: Dataflow, fail) -> None:
    meta = schedule.meta
    where = {
        (a.kind, a.stage, a.chunk, a.mb)
        for acts in schedule.ranks
        for a in acts
        if a.kind in ("F", "B", "W")
    }
    last_step = {r: max(len(acts) - 1, 0) for r, acts in enumerate(schedule.ranks)}
    for s in range(meta.pp):
        for v in range(meta.vpp):
            for m in range(meta.total_microbatches):
                kinds = ("F", "B") if meta.trains(m) else ("F",)
                if meta.trains(m) and (s, v, m) in meta.backbone_wgrad:
                    kinds += ("W",)
                for kind in kinds:
                    if (kind, s, v, m) not in where:
                        fail(s, last_step[s], "missing", f"no {kind}:s{s}v{v}m{m} on rank {s}")

    # Encoder work: one pipeline per micro-batch, every stage's kernels covered exactly once.
    cover: dict[tuple, list[tuple[int, int, int, int]]] = defaultdict(list)
    pipes: dict[tuple[int, int], set[int]] = defaultdict(set)
    for r, acts in enumerate(schedule.ranks):
        for i, a in enumerate(acts):
            if a.kind in ENCODER_KINDS:
                cover[(a.kind, a.enc, a.stage, a.mb)].append((a.k0, a.k1, r, i))
                pipes[(a.enc, a.mb)].add(a.pipe)
    for e, enc in enumerate(meta.encoders):
        host = enc.placement[0][0][0]
        for m in filter(meta.has_images, range(meta.total_microbatches)):
            if len(pipes[(e, m)]) > 1:
                r, i = min((c[2], c[3]) for c in cover[("EF", e, 0, m)] or [(0, 0, host, 0)])
                fail(
                    r,
                    i,
                    "pipe",
                    f"encoder {e} micro-batch {m} runs on pipelines "
                    f"{sorted(pipes[(e, m)])}; one pipeline must do all its stages",
                )
            for s in range(enc.num_stages):
                totals = [("EF", enc.fwd_kernels[s])]
                if meta.trains(m):
                    totals += [("EB", enc.bwd_kernels[s]), ("EW", enc.wgt(s))]
                for kind, total in totals:
                    chunks = sorted(cover[(kind, e, s, m)])
                    pos = 0
                    for k0, k1, r, i in chunks:
                        if k0 != pos or k1 > total:
                            fail(
                                r,
                                i,
                                "kernel-cover",
                                f"{kind} e{e} s{s} m{m} kernels must tile "
                                f"[0, {total}) without gap or overlap; expected k{pos}-..",
                            )
                        pos = k1
                    if pos != total:
                        r = flow.encoder_rank(e, m, s)
                        r = host if r is None else r
                        fail(
                            r,
                            last_step[r],
                            "missing" if pos == 0 else "kernel-cover",
                            f"{kind} e{e} s{s} m{m} covers kernels [0, {pos}) of [0, {total})",
                        )

    # Data-parallel collectives: each rank gathers and reduces what it holds.
    for r, acts in enumerate(schedule.ranks):
        parts = Counter(a.key for a in acts if a.kind == "AG")
        reds = Counter(a.key for a in acts if a.kind == "RS")
        hosted = {part_name(a.enc) for a in acts if a.kind == "EF"}
        trained = {part_name(a.enc) for a in acts if a.kind == "EB"}
        for part in {"bb"} | hosted:
            if parts[part] != 1:
                fail(
                    r,
                    last_step[r],
                    "missing",
                    f"rank {r} needs exactly one AG:{part}, has {parts[part]}",
                )
        for part in {"bb"} | trained:
            if reds[part] != 1:
                fail(
                    r,
                    last_step[r],
                    "missing",
                    f"rank {r} needs exactly one RS:{part}, has {reds[part]}",
                )


def _check_pairs(schedule: Schedule, fail) -> None:
    sends = {
        a.key: (r, i)
        for r, acts in enumerate(schedule.ranks)
        for i, a in enumerate(acts)
        if a.kind == "SEND"
    }
    recvs = {
        a.key: (r, i)
        for r, acts in enumerate(schedule.ranks)
        for i, a in enumerate(acts)
        if a.kind == "RECV"
    }
    for key, (r, i) in sends.items():
        if key not in recvs:
            fail(r, i, "unpaired", f"SEND:{key} has no matching RECV:{key}")
    for key, (r, i) in recvs.items():
        if key not in sends:
            fail(r, i, "unpaired", f"RECV:{key} has no matching SEND:{key}")


def _check_dataflow(schedule: Schedule, flow: Dataflow, fail) -> None:
    """Run the lists in order, blocking RECVs on their SENDs; report order errors and deadlock."""
    ranks = schedule.ranks
    groups = [backbone_groups(acts) for acts in ranks]
    made_at: list[dict[str, int]] = []
    for acts in ranks:
        table: dict[str, int] = {}
        for i, a in enumerate(acts):
            for k in flow.makes(a):
                table.setdefault(k, i)
        made_at.append(table)
    needs = [
        [flow.rs_needs(r, acts, a.key) if a.kind == "RS" else flow.needs(a) for a in acts]
        for r, acts in enumerate(ranks)
    ]
    avail: list[set[str]] = [set() for _ in ranks]
    sent: set[str] = set()
    ptr = [0] * len(ranks)
    while True:
        progressed = False
        for r, acts in enumerate(ranks):
            while ptr[r] < len(groups[r]):
                group = groups[r][ptr[r]]
                if any(acts[i].kind == "RECV" and acts[i].key not in sent for i in group):
                    break
                # The backbone action cannot use what its fills make, and a fill cannot use
                # what its backbone action makes; fills run in list order inside it.
                main, fills = group[-1], group[:-1]
                local: set[str] = set()
                for i in [main, *fills]:
                    for k in needs[r][i]:
                        if k in avail[r] or (i != main and k in local):
                            continue
                        key = TensorKey.try_parse(k)
                        rule = RULES.get(key.kind, "dependency") if key else "dependency"
                        at = made_at[r].get(k)
                        if at is not None and at in group:
                            fail(
                                r,
                                i,
                                "order",
                                f"{rule}: {k} is made by {acts[at]}, which runs "
                                "at the same time (TP-bubble fill)",
                            )
                        if at is not None:
                            fail(r, i, "order", f"{rule}: {k} is made later, at step {at}")
                        if key is not None and key.is_transfer:
                            fail(r, i, "order", f"{rule}: no RECV:{k} before this step on rank {r}")
                        fail(r, i, "order", f"{rule}: nothing on rank {r} makes {k}")
                    if i != main:
                        local.update(flow.makes(acts[i]))
                for i in group:
                    avail[r].update(flow.makes(acts[i]))
                    if acts[i].kind == "SEND":
                        sent.add(acts[i].key)
                ptr[r] += 1
                progressed = True
        if all(ptr[r] == len(groups[r]) for r in range(len(ranks))):
            return
        if not progressed:
            stuck = [
                (r, groups[r][ptr[r]][-1]) for r in range(len(ranks)) if ptr[r] < len(groups[r])
            ]
            waits = ", ".join(f"rank {r} on {ranks[r][i]}" for r, i in stuck)
            r, i = stuck[0]
            fail(r, i, "deadlock", f"no rank can make progress: {waits}")
