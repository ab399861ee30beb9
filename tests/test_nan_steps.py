"""--check-for-nan-in-loss-and-grad: a NaN step is skipped (state unchanged), counted, and
--max-skipped-iterations of them in a row stop the run in one line, keeping the last good
checkpoint. The NaN comes from the test's fault hooks (train.main's `faults`), not a flag."""

import re

import pytest

from tests.pretrain_runs import COMMON, torchrun

PP2 = ["--pipeline-model-parallel-size", "2", *COMMON[:2], "--lr", "1e-2"]


def nan_at(*steps: int):
    """Fault hooks making the loss of `steps` (0-based) NaN."""
    from megatron_mllm.runtime.job import FaultHooks

    return FaultHooks(nan_loss_steps=frozenset(steps))


def counts(stdout: str) -> list[tuple[str, str]]:
    pattern = r"skipped iterations:\s+(\d+) \| number of nan iterations:\s+(\d+)"
    return re.findall(pattern, stdout)


def test_a_nan_step_is_skipped_counted_and_not_saved(tmp_path):
    """Step 1 (iteration 2) is NaN: skipped, counted, and the save that falls on it is not
    taken (a skip is where a poisoned state shows); the next iteration saves again."""
    args = [*PP2, "--train-iters", "3", "--use-distributed-optimizer", "--bf16"]
    out = torchrun(*args, "--save", str(tmp_path), "--save-interval", "1", faults=nan_at(1))
    assert out.returncode == 0, out.stderr[-2000:]
    assert counts(out.stdout) == [("0", "0"), ("1", "1"), ("0", "0")]
    assert " > save at iteration 2 not taken: the last 1 iteration(s) had a NaN" in out.stdout
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000001", "iter_0000003"]


def test_a_skipped_step_leaves_the_parameters_unchanged():
    """bf16 with the distributed optimizer: two steps whose second is NaN end with the
    parameters of one step, bit for bit (the state a skipped step would have saved)."""
    from dataclasses import replace

    import torch

    from megatron_mllm.models.config import TINY
    from megatron_mllm.parallel.plans import ParallelPlan
    from megatron_mllm.runtime.assembly.launch import spawn
    from megatron_mllm.runtime.job import (
        Collect,
        DataParts,
        FaultHooks,
        ModelParts,
        OptimizerSettings,
        PlanParts,
        RuntimeJob,
    )
    from megatron_mllm.runtime.modes.reference import make_full_state
    from megatron_mllm.runtime.modes.runs import run_rank
    from megatron_mllm.runtime.planning.schedules import runtime_schedule

    plan = ParallelPlan(1, 1, 2)
    state = spawn(make_full_state, 1, TINY, 0)[0]
    opt = OptimizerSettings(lr=1e-2, distributed=True, overlap_grad_reduce=True)
    job = RuntimeJob(
        ModelParts(TINY, state, precision="bf16"),
        PlanParts(plan, runtime_schedule(TINY, plan, 1, 4, "optimus")),
        DataParts(1, 4),
        steps=1,
        optimizer=opt,
        collect=Collect(grads=False, params=True),
    )
    one = spawn(run_rank, 2, job)
    two = spawn(run_rank, 2, replace(job, steps=2, faults=FaultHooks(nan_loss_steps={1})))
    assert [o["skipped_iterations"] for o in two] == [1, 1]
    for a, b in zip(one, two, strict=True):
        assert a["params"].keys() == b["params"].keys()
        for name, tensor in a["params"].items():
            assert torch.equal(tensor[0], b["params"][name][0]), name


@pytest.mark.slow  # the skip itself runs in make test (above)
def test_nan_steps_in_a_row_stop_the_run_and_keep_the_last_checkpoint(tmp_path):
    args = [*PP2, "--train-iters", "8", "--max-skipped-iterations", "3"]
    out = torchrun(
        *args, "--save", str(tmp_path), "--save-interval", "1", faults=nan_at(2, 3, 4, 5, 6, 7)
    )
    assert out.returncode != 0
    line = "error: 3 iterations in a row (the last 5) had a NaN or Inf loss or gradient norm"
    assert line in out.stderr, out.stderr[-2000:]
    # the saves at 3 and 4 fell inside the streak: not taken
    assert " > save at iteration 4 not taken: the last 2 iteration(s)" in out.stdout
    assert "the latest checkpoint stays iteration 2" in out.stderr
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "2"
    # ours comes first, not inside a traceback; the launcher's report may follow
    assert out.stderr.index(line) < out.stderr.find("Traceback") or "Traceback" not in out.stderr


@pytest.mark.slow
def test_without_the_check_a_nan_step_is_applied(tmp_path):
    args = [*PP2, "--train-iters", "3", "--no-check-for-nan-in-loss-and-grad"]
    out = torchrun(*args, "--save", str(tmp_path), faults=nan_at(1))
    assert out.returncode != 0  # NaN parameters are never saved, even then
    assert "parameters hold NaN or Inf at iteration 3: not saved; no checkpoint" in out.stderr
