"""Tensor keys: one type builds and parses them, and their string forms stay what they were."""

from __future__ import annotations

import pickle

import pytest

from megatron_mllm.errors import ConfigError
from megatron_mllm.models.config import TINY
from megatron_mllm.parallel.plans import ParallelPlan
from megatron_mllm.runtime.engine.program import Op, all_programs
from megatron_mllm.runtime.planning.schedules import runtime_plan
from megatron_mllm.schedule.actions import parse_action
from megatron_mllm.schedule.dataflow import RULES, Dataflow
from megatron_mllm.schedule.keys import (
    TRANSFER_KEY_KINDS,
    TensorKey,
    cost_name,
    part_encoder,
    part_name,
)

# Every constructor, with the exact string the IR, CSVs, traces and message tags use.
SPELLED = [
    (TensorKey.act(1, 0, 3), "act.s1v0.m3"),
    (TensorKey.grad(0, 2, 11), "grad.s0v2.m11"),
    (TensorKey.fwd(1, 1, 0), "fwd.s1v1.m0"),
    (TensorKey.bwd(3, 0, 7), "bwd.s3v0.m7"),
    (TensorKey.eout(0, 2), "eout.e0.m2"),
    (TensorKey.egrad(1, 5), "egrad.e1.m5"),
    (TensorKey.eact(0, 1, 4), "eact.e0.s1.m4"),
    (TensorKey.egin(2, 0, 3), "egin.e2.s0.m3"),
    (TensorKey.ebdone(0, 1, 9), "ebdone.e0.s1.m9"),
    (TensorKey.ek(0, 1, 2, 12), "ek.e0.s1.m2.k12"),
    (TensorKey.ebk(1, 0, 3, 4), "ebk.e1.s0.m3.k4"),
    (TensorKey.ewk(0, 1, 3, 2), "ewk.e0.s1.m3.k2"),
    (TensorKey.wgt(1, 0, 5), "wgt.s1v0.m5"),
    (TensorKey.params(), "params.bb"),
    (TensorKey.params(3), "params.e3"),
    (TensorKey.params_of("bb"), "params.bb"),
    (TensorKey.params_of("e10"), "params.e10"),
]
ALL_KINDS = set(RULES)


@pytest.mark.parametrize("key, text", SPELLED, ids=[t for _, t in SPELLED])
def test_constructors_spell_todays_strings(key, text):
    assert str(key) == text
    assert TensorKey.parse(text) == key
    assert str(TensorKey.parse(text)) == text


def test_every_kind_has_a_rule_and_a_constructor():
    assert {k.kind for k, _ in SPELLED} == ALL_KINDS
    assert set(TRANSFER_KEY_KINDS) <= ALL_KINDS
    assert [k.is_transfer for k, _ in SPELLED[:6]] == [True, True, False, False, True, True]


def test_fields_a_kind_lacks_are_none():
    assert TensorKey.act(1, 0, 3) == TensorKey("act", stage=1, chunk=0, mb=3)
    assert TensorKey.eout(0, 2) == TensorKey("eout", enc=0, mb=2)
    assert TensorKey.ek(0, 1, 2, 3) == TensorKey("ek", 0, 1, None, 2, 3)
    assert TensorKey.params().enc is None and TensorKey.params().part == "bb"
    assert TensorKey.params(2).part == "e2"


def _schedules():
    yield "optimus-pp2", *runtime_plan(TINY, ParallelPlan(1, 1, 2), 1, 4, "optimus"), (1, 1, 2)
    yield "megatron-pp2", *runtime_plan(TINY, ParallelPlan(1, 1, 2), 1, 4, "megatron"), (1, 1, 2)
    yield (
        "kernel-tp2",
        *runtime_plan(TINY, ParallelPlan(1, 2, 1), 1, 4, "optimus", unit="kernel"),
        (1, 2, 1),
    )


@pytest.fixture(scope="module")
def produced():
    """Every key string dataflow makes, needs, and sends for three real schedules."""
    out = {}
    for name, schedule, workload, plan in _schedules():
        flow = Dataflow(schedule.meta, schedule.encoder_assignment())
        keys = set()
        for r, acts in enumerate(schedule.ranks):
            for a in acts:
                keys.update(flow.needs(a), flow.makes(a))
                if a.kind == "RS":
                    keys.update(flow.rs_needs(r, acts, a.key))
                if a.kind in ("SEND", "RECV"):
                    keys.add(a.key)
        bplan = ParallelPlan(*plan)
        programs = all_programs(schedule, bplan, bplan, bplan.tp)
        ops = [op for program in programs.values() for op in program if op.kind != "run"]
        out[name] = (keys, ops, workload)
    return out


def test_every_produced_key_round_trips(produced):
    kinds = set()
    for name, (keys, ops, _) in produced.items():
        assert keys, name
        for s in keys | {op.key for op in ops}:
            k = TensorKey.parse(s)
            assert str(k) == s, (name, s)
            assert TensorKey.parse(str(k)) == k, (name, s)
            kinds.add(k.kind)
    # The three schedules between them use every kind but a split backward's (their own tests:
    # test_weight_split.py, test_backbone_weight_split.py)
    assert kinds == ALL_KINDS - {"ewk", "wgt"}


# Tags of a few keys, written down once: a change to the tag function (or to a key's string)
# breaks the wire format between ranks of different versions, and this test.
KNOWN_TAGS = {"act.s1v0.m3": 15813052, "eout.e0.m1": 67672091, "egrad.e0.m2": 47905861}


def test_messages_are_transfer_keys_with_unchanged_tags(produced):
    for key, tag in KNOWN_TAGS.items():
        assert Op("send", key=key, peer=1).tag == tag, key
    seen = {}
    for keys, ops, workload in produced.values():
        for op in ops:
            key = TensorKey.parse(op.key)
            assert key.is_transfer
            assert 0 <= op.tag < 2**27
            assert seen.setdefault(op.key, op.tag) == op.tag  # one tag a key, in every program
            assert workload.transfer_time(key) == workload.transfer_time(op.key) > 0
        assert all(not TensorKey.parse(k).is_transfer for k in keys if k.startswith("params."))
    tags = {}
    for key, tag in seen.items():
        assert tags.setdefault(tag, key) == key, (key, tags[tag])  # distinct keys, distinct tags


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "act",
        "act.",
        "act.s1v0",
        "act.s1v0.m3.k1",
        "act.s01v0.m3",  # not canonical: str(parse(s)) would differ
        "act.s-1v0.m3",
        "act.s1v0.m3 ",
        " act.s1v0.m3",
        "ACT.s1v0.m3",
        "act.e0.m3",
        "eout.e0.s1.m2",
        "eout.e0",
        "eact.e0.m1",
        "ek.e0.s0.m0",
        "ebdone.e0.s0.m0.k1",
        "foo.e0.m1",
        "params",
        "params.b",
        "params.e01",
        "params.e",
        "params.bb.m0",
    ],
)
def test_bad_strings_raise_naming_them(bad):
    with pytest.raises(ValueError) as err:
        TensorKey.parse(bad)
    assert repr(bad) in str(err.value)
    assert TensorKey.try_parse(bad) is None


def test_non_strings_do_not_parse():
    with pytest.raises(ValueError):
        TensorKey.parse(None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "fields",
    [
        {"kind": "nope", "mb": 0},
        {"kind": "act", "stage": 1, "chunk": 0},  # no mb
        {"kind": "act", "stage": 1, "chunk": 0, "mb": 0, "enc": 0},  # act has no enc
        {"kind": "eout", "enc": 0, "mb": 1, "stage": 0},
        {"kind": "ek", "enc": 0, "stage": 0, "mb": 0},  # no k
        {"kind": "params", "mb": 0},
        {"kind": "act", "stage": -1, "chunk": 0, "mb": 0},
        {"kind": "act", "stage": True, "chunk": 0, "mb": 0},
        {"kind": "act", "stage": "1", "chunk": 0, "mb": 0},
        {"kind": "params", "enc": -2},
    ],
)
def test_malformed_keys_cannot_be_built(fields):
    with pytest.raises(ValueError):
        TensorKey(**fields)


def test_numpy_integers_become_ints():
    np = pytest.importorskip("numpy")
    k = TensorKey("act", stage=np.int64(1), chunk=np.int32(0), mb=np.int64(3))
    assert type(k.stage) is int and str(k) == "act.s1v0.m3" and k == TensorKey.act(1, 0, 3)


def test_keys_are_frozen_hashable_and_pickle():
    k = TensorKey.ek(0, 1, 2, 3)
    with pytest.raises(AttributeError):
        k.mb = 4  # type: ignore[misc]
    assert {k: 1}[TensorKey.parse("ek.e0.s1.m2.k3")] == 1
    assert pickle.loads(pickle.dumps(k)) == k and str(pickle.loads(pickle.dumps(k))) == str(k)
    assert "_text" not in repr(k)


def test_parts_and_cost_names():
    assert part_name(None) == "bb" and part_name(2) == "e2"
    assert part_encoder("bb") is None and part_encoder("e12") == 12
    for bad in ("", "b", "e", "e01", "e-1", "bbb", "E0"):
        with pytest.raises(ValueError, match=repr(bad)):
            part_encoder(bad)
    assert cost_name("act") == "act" and cost_name("eout", 1) == "eout.e1"
    assert TensorKey.act(1, 0, 3).cost_name == "act"
    assert TensorKey.egin(1, 0, 3).cost_name == "egin.e1"
    assert TensorKey.ek(1, 0, 3, 2).cost_name == "ek"  # kept on the rank: no transfer cost
    with pytest.raises(ValueError):
        _ = TensorKey.act(1, 0, 3).part


@pytest.mark.parametrize("text", ["SEND:act.s01v0.m3", "RECV:foo.e0.m1", "AG:e01", "RS:b"])
def test_actions_with_bad_keys_are_one_clear_error(text):
    with pytest.raises(ConfigError) as err:
        parse_action(text)
    assert text in str(err.value) and "\n" not in str(err.value)


def test_op_keys_stay_strings():
    op = Op("send", key=str(TensorKey.eout(0, 1)), peer=1)
    assert op.key == "eout.e0.m1" and isinstance(op.key, str)
    assert str(op) == "SEND:eout.e0.m1->rank1"
    assert str(Op("recv", key="act.s1v0.m3", peer=0)) == "RECV:act.s1v0.m3<-rank0"
    assert op.tag == KNOWN_TAGS["eout.e0.m1"]
