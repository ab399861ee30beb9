"""--check-for-nan-in-loss-and-grad: a NaN step is skipped (state unchanged), counted, and
--max-skipped-iterations of them in a row stop the run in one line, keeping the last good
checkpoint. The NaN comes from the test hook (MEGATRON_MLLM_TEST_NAN_LOSS_STEPS), not a flag."""

import re

import pytest

from tests.test_training import COMMON, assert_same_checkpoint, torchrun

PP2 = ["--pipeline-model-parallel-size", "2", *COMMON[:2], "--lr", "1e-2"]
NAN = "MEGATRON_MLLM_TEST_NAN_LOSS_STEPS"


def counts(stdout: str) -> list[tuple[str, str]]:
    pattern = r"skipped iterations:\s+(\d+) \| number of nan iterations:\s+(\d+)"
    return re.findall(pattern, stdout)


def test_a_nan_step_is_skipped_counted_and_leaves_the_state_unchanged(tmp_path):
    args = [*PP2, "--train-iters", "3", "--use-distributed-optimizer", "--bf16"]
    out = torchrun(*args, "--save", str(tmp_path), "--save-interval", "1", env={NAN: "1"})
    assert out.returncode == 0, out.stderr[-2000:]  # step 1 is iteration 2
    assert counts(out.stdout) == [("0", "0"), ("1", "1"), ("0", "0")]
    assert_same_checkpoint(tmp_path / "iter_0000001", tmp_path / "iter_0000002")


@pytest.mark.slow  # the skip itself runs in make test (above)
def test_nan_steps_in_a_row_stop_the_run_and_keep_the_last_checkpoint(tmp_path):
    args = [*PP2, "--train-iters", "8", "--max-skipped-iterations", "3"]
    out = torchrun(*args, "--save", str(tmp_path), "--save-interval", "1", env={NAN: "2,3,4,5,6,7"})
    assert out.returncode != 0
    line = "error: 3 iterations in a row (the last 5) had a NaN or Inf loss or gradient norm"
    assert line in out.stderr, out.stderr[-2000:]
    assert "the latest checkpoint stays iteration 4" in out.stderr
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "4"
    # ours comes first, not inside a traceback; the launcher's report may follow
    assert out.stderr.index(line) < out.stderr.find("Traceback") or "Traceback" not in out.stderr


@pytest.mark.slow
def test_without_the_check_a_nan_step_is_applied(tmp_path):
    args = [*PP2, "--train-iters", "3", "--no-check-for-nan-in-loss-and-grad"]
    out = torchrun(*args, "--save", str(tmp_path), env={NAN: "1"})
    assert out.returncode != 0  # NaN parameters are never saved, even then
    assert "parameters hold NaN or Inf at iteration 3: not saved; no checkpoint" in out.stderr
