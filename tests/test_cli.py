"""plan_schedule.py / check_schedule.py: output shape, and one clear line for every bad input."""

import json

import pytest

SMALL = [
    "--encoder",
    "vit-3b",
    "--backbone",
    "gpt-11b",
    "--gpus",
    "64",
    "--tp",
    "4",
    "--pp",
    "4",
    "--global-batch",
    "64",
    "--micro-batch",
    "1",
    "--seq-len",
    "1024",
]


def args_with(**changes):
    out = list(SMALL)
    for flag, value in changes.items():
        flag = "--" + flag.replace("_", "-")
        if flag in out:
            out[out.index(flag) + 1] = value
        else:
            out += [flag, value]
    return out


def test_json_output(run_tool):
    proc = run_tool("plan_schedule.py", *SMALL, "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out["schedules"]) == {"megatron", "balanced", "optimus"}
    for entry in out["schedules"].values():
        assert entry["step_time_s"] > 0 and 0 <= entry["bubble_ratio"] < 1
        assert entry["peak_memory_gb"] > 0
    plan = out["schedules"]["optimus"]["encoder_plan"]
    assert plan["dp"] * plan["tp"] * plan["pp"] == 64
    assert out["limit_step_time_s"] <= out["schedules"]["optimus"]["step_time_s"]
    # Strict: this job has pipeline bubbles for the encoder to fill.
    assert out["schedules"]["optimus"]["step_time_s"] < out["schedules"]["megatron"]["step_time_s"]
    assert out["planner_seconds"] < 10


def test_table_trace_png_and_csv(run_tool, tmp_path):
    trace, png, csv = tmp_path / "t.json", tmp_path / "t.png", tmp_path / "s.csv"
    proc = run_tool(
        "plan_schedule.py",
        *SMALL,
        "--trace",
        str(trace),
        "--png",
        str(png),
        "--save-schedule",
        str(csv),
    )
    assert proc.returncode == 0, proc.stderr
    assert "megatron" in proc.stdout and "optimus" in proc.stdout and "speedup" in proc.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events if e["ph"] == "X"} == set(range(4))
    assert any(e["name"].startswith("EF:") for e in events if e["ph"] == "X")
    assert png.read_bytes()[:4] == b"\x89PNG"
    check = run_tool("check_schedule.py", str(csv))
    assert check.returncode == 0 and check.stdout.startswith("valid:")


BAD = {
    "gpus not divisible": (args_with(gpus="60"), "divisible by 16"),
    "encoder PP not dividing PP": (args_with(encoder_pp="3"), "does not divide backbone PP"),
    "encoder TP not dividing TP": (
        args_with(encoder_tp="3", encoder_pp="1"),
        "does not divide backbone TP",
    ),
    "more stages than layers": (args_with(pp="4", vpp="32"), "layers"),
    "batch not divisible": (args_with(global_batch="6"), "not divisible by micro-batch x DP"),
    "cannot fit in memory": (
        args_with(backbone="gpt-175b", gpus="8", tp="8", pp="1", global_batch="8"),
        "fits in 80 GB",
    ),
    "unknown model": (args_with(encoder="vit-99b"), "unknown model 'vit-99b'"),
    "unknown gpu": (args_with(gpu="tpu"), "unknown GPU 'tpu'"),
    "bad efficiency": (args_with(efficiency="3"), "--efficiency"),
    "huge global batch": (args_with(global_batch="32000000"), "micro-batches per pipeline, over"),
    "measured times a directory": (args_with(measured_times="/tmp"), "/tmp is a directory"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_input_is_one_line_exit_2(run_tool, case):
    argv, expected = BAD[case]
    proc = run_tool("plan_schedule.py", *argv)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert expected in lines[0]
    assert "Traceback" not in proc.stderr


def test_malformed_yaml(run_tool, tmp_path):
    bad = tmp_path / "m.yaml"
    bad.write_text("num_layers: [1, 2\nhidden_size: 4\n")
    proc = run_tool("plan_schedule.py", *args_with(encoder=str(bad)))
    assert proc.returncode == 2 and "malformed YAML" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    bad.write_text("num_layers: 4\nhidden_size: 100\nnum_heads: 3\n")
    proc = run_tool("plan_schedule.py", *args_with(encoder=str(bad)))
    assert proc.returncode == 2 and "not divisible by num_heads" in proc.stderr


def test_yaml_model_plans(run_tool, tmp_path):
    spec = tmp_path / "my-vit.yaml"
    spec.write_text("num_layers: 8\nhidden_size: 1024\nnum_heads: 8\nseq_len: 576\n")
    proc = run_tool("plan_schedule.py", *args_with(encoder=str(spec)), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["schedules"]["optimus"]["step_time_s"] > 0


def test_malformed_csv(run_tool, tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("rank,actions\n0,F:s0v0m0\n")
    proc = run_tool("check_schedule.py", str(bad))
    assert proc.returncode == 2 and "first line must be" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def one_line(proc, expected: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and expected in lines[0], proc.stderr


def test_tools_loose_ends_fail_in_one_line(run_tool, tmp_path):
    """A binary or directory CSV, empty measured times, a CSV whose backbone_layers has the
    wrong length."""
    binary = tmp_path / "binary.csv"
    binary.write_bytes(bytes(range(256)) * 4)
    one_line(run_tool("check_schedule.py", str(binary)), "is not text (not a schedule CSV)")
    one_line(run_tool("check_schedule.py", str(tmp_path)), "is a directory")
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    one_line(run_tool("plan_schedule.py", *SMALL, "--measured-times", str(empty)), "non-empty")
    csv = tmp_path / "s.csv"
    assert run_tool("plan_schedule.py", *SMALL, "--save-schedule", str(csv)).returncode == 0
    text = csv.read_text()
    meta = json.loads(text.splitlines()[0][len("# meta ") :])
    meta["backbone_layers"] = meta["backbone_layers"][:-1]
    csv.write_text("# meta " + json.dumps(meta) + "\n" + text.split("\n", 1)[1])
    one_line(run_tool("check_schedule.py", str(csv)), "must give each of the 4 virtual stages")


def test_encoder_set_and_measured_times_mismatches_fail_clearly(run_tool, tmp_path):
    """Two encoders whose shared encoder plan cannot hold the smaller one, and a measured-times
    file for a model that is not in the run: one line each."""
    small = tmp_path / "small_vit.yaml"
    small.write_text("num_layers: 2\nhidden_size: 1024\nnum_heads: 16\n")
    times = tmp_path / "times.json"
    times.write_text(json.dumps({"other-vit": {"forward": {"ln1": 0.1}}}))
    cases = [
        (
            [*SMALL, "--encoder", str(small), "--encoder-tp", "1", "--encoder-pp", "4"],
            "more stages than the encoder's 2 layers",
        ),
        ([*SMALL, "--measured-times", str(times)], "model 'other-vit' is not in this run"),
    ]
    for argv, expected in cases:
        proc = run_tool("plan_schedule.py", *argv)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and expected in lines[0], proc.stderr


@pytest.mark.slow  # 16 s (subprocesses); tests/test_lookahead.py covers the merge
def test_coreset_lookahead_prediction(run_tool):
    """--coreset-pool-ratio: the Optimus step with the next pool's forward merged in, against
    the pool's own pass then the step, and the pool trained whole (accumulation)."""
    proc = run_tool("plan_schedule.py", *SMALL, "--coreset-pool-ratio", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    pred = json.loads(proc.stdout)["coreset_lookahead"]
    assert pred["order"] == "simulated"  # pretrain_mllm.py's default
    assert pred["lookahead_step_s"] < pred["step_alone_s"] + pred["pool_alone_s"]
    order = ("--coreset-lookahead-order", "pool-first")
    proc = run_tool("plan_schedule.py", *SMALL, "--coreset-pool-ratio", "2", *order, "--json")
    first = json.loads(proc.stdout)["coreset_lookahead"]
    assert first["order"] == "pool-first"
    assert pred["lookahead_step_s"] <= first["lookahead_step_s"]  # the pool first is a candidate
    assert pred["step_alone_s"] < pred["accumulation_s"]
    table = run_tool("plan_schedule.py", *SMALL, "--coreset-pool-ratio", "2").stdout
    assert "coreset look-ahead (pool 2 x B)" in table.splitlines()[-1]
    for bad in ("0.5", "nan", "1.01"):  # 1.01: not whole micro-batches per replica
        proc = run_tool("plan_schedule.py", *SMALL, "--coreset-pool-ratio", bad)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "--coreset-pool-ratio" in proc.stderr
