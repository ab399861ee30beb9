import pytest

from megatron_mllm.errors import ConfigError
from megatron_mllm.schedule.actions import AG, EB, EF, RECV, RS, SEND, B, F, parse_action
from megatron_mllm.schedule.baselines import megatron_schedule
from megatron_mllm.schedule.blocks import JobCosts
from megatron_mllm.schedule.schedule import Schedule
from tests.conftest import tiny_job

ALL = [
    F(1, 3),
    B(0, 2, chunk=1),
    EF(0, 1, 2, 3, 0, 12),
    EB(1, 0, 0, 5, 4, 7, fill=2),
    SEND("act.s1v0.m3"),
    RECV("eout.e0.m2"),
    SEND("eact.e0.s1.m4"),
    AG("bb"),
    RS("e1"),
]


@pytest.mark.parametrize("action", ALL, ids=str)
def test_string_form_round_trips(action):
    assert parse_action(str(action)) == action


def test_string_forms_are_short_and_stable():
    assert [str(a) for a in ALL[:4]] == [
        "F:s1v0m3",
        "B:s0v1m2",
        "EF:e0p1s2m3k0-12",
        "EB:e1p0s0m5k4-7@tp2",
    ]


@pytest.mark.parametrize("text", ["X:s0v0m0", "F:s0m0", "EF:e0p0s0m0k3-3", "SEND:", "AG:foo"])
def test_bad_action_text_is_one_clear_error(text):
    with pytest.raises(ConfigError) as err:
        parse_action(text)
    assert text.strip() in str(err.value) and "\n" not in str(err.value)


def test_csv_round_trip(tmp_path):
    schedule, _ = megatron_schedule(JobCosts(tiny_job()))
    path = tmp_path / "s.csv"
    schedule.to_csv(path)
    loaded = Schedule.from_csv(path)
    assert loaded.meta == schedule.meta
    assert loaded.ranks == schedule.ranks


def test_malformed_csv_names_the_line(tmp_path):
    schedule, _ = megatron_schedule(JobCosts(tiny_job()))
    lines = schedule.to_csv().splitlines()
    lines[2] = lines[2].replace("F:s1v0m0", "F:s1v0mX")
    path = tmp_path / "bad.csv"
    path.write_text("\n".join(lines))
    with pytest.raises(ConfigError, match="line 3"):
        Schedule.from_csv(path)
    path.write_text("0,F:s0v0m0\n")
    with pytest.raises(ConfigError, match="first line must be"):
        Schedule.from_csv(path)
