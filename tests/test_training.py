"""pretrain_mllm.py end to end under torchrun: Megatron log lines, torch_dist checkpoints,
bit-identical resume, resharding to another pair of plans, and clear errors."""

import os
import re
import subprocess
import sys

import pytest

from megatron_mllm.runtime.assembly.launch import free_port
from tests.conftest import ROOT
from tests.pretrain_runs import (
    COMMON,
    LLAVA,
    assert_close_checkpoint,
    assert_refused_in_one_line,
    assert_same_checkpoint,
    checkpoint_objects,
    losses,
    refused,
    resumed_at_2_is_bit_exact,
    torchrun,
)


@pytest.mark.slow  # four torchrun jobs; the bit-exact bf16 resume below runs in make test
def test_distributed_optimizer_resumes_bit_exactly_and_reshards(tmp_path):
    """--use-distributed-optimizer at DP=2 saves its sharded state; a resume at DP=2 writes the
    same tensors bit for bit; the checkpoint loads at DP=1 (distributed optimizer) and on a PP=2
    backbone without it, and both write the same iteration-4 tensors within rounding."""
    args = [*COMMON, "--train-iters", "4", "--use-distributed-optimizer", "--overlap-grad-reduce"]
    straight, resumed, ref = resumed_at_2_is_bit_exact(tmp_path, args)
    for name, extra, nproc in (
        ("dp1", ["--use-distributed-optimizer"], 1),
        ("pp2", ["--pipeline-model-parallel-size", "2"], 2),
    ):
        out = torchrun(
            *COMMON, "--train-iters", "4", *extra, "--load", str(tmp_path / "a"),
            "--save", str(tmp_path / name), nproc=nproc,
        )  # fmt: skip
        assert out.returncode == 0, (name, out.stderr[-2000:])
        got = losses(out.stdout)
        assert all(abs(got[i] - ref[i]) < 1e-4 for i in (3, 4)), (name, got, ref)
        assert_close_checkpoint(
            tmp_path / "a" / "iter_0000004", tmp_path / name / "iter_0000004", 1e-4
        )


# bf16 with the distributed optimizer also trains and checkpoints in make test
# (test_nan_steps, bit for bit across a skipped step); the resume comparisons run in CI's slow set
@pytest.mark.parametrize(
    "precision",
    [
        pytest.param("--bf16", marks=pytest.mark.slow),
        pytest.param("--fp16", marks=pytest.mark.slow),
    ],
)
def test_low_precision_distributed_optimizer_resumes_bit_exactly(tmp_path, precision):
    """bf16 (fp16, with its loss scale) with the distributed optimizer and overlapped parameter
    gathering on PP=2: the checkpoint holds the fp32 main parameters, moments and the loss
    scaler (current, though the model's copies await the next step's gather); a resumed run
    writes the same tensors bit for bit."""
    args = ["--pipeline-model-parallel-size", "2", *COMMON, "--train-iters", "4"]
    args += [precision, "--use-distributed-optimizer", "--overlap-param-gather"]
    args += ["--initial-loss-scale", "4096"]
    straight, resumed, ref = resumed_at_2_is_bit_exact(tmp_path, args)
    if precision == "--fp16":
        assert "loss scale: 4096.0 |" in straight.stdout and "loss scale" in resumed.stdout
        assert got_scales(straight.stdout)[4] == got_scales(resumed.stdout)[4]


def got_scales(stdout: str) -> dict[int, float]:
    """Iteration -> loss scale, from Megatron's log lines (fp16)."""
    return {
        int(m[1]): float(m[2])
        for m in re.finditer(r"iteration\s+(\d+)/\s*\d+ \|.*?loss scale: ([0-9.]+) \|", stdout)
    }


@pytest.mark.slow  # bit-exact resume runs in make test with bf16 and with conversation data
def test_resume_is_bit_identical_and_reshards(tmp_path):
    straight = torchrun(
        "--pipeline-model-parallel-size",
        "2",
        *COMMON,
        "--save",
        str(tmp_path / "a"),
        "--save-interval",
        "3",
        "--tensorboard-dir",
        str(tmp_path / "tb"),
    )
    assert straight.returncode == 0, straight.stderr[-2000:]
    ref = losses(straight.stdout)
    assert sorted(ref) == [1, 2, 3, 4, 5, 6]
    assert (tmp_path / "a" / "latest_checkpointed_iteration.txt").read_text() == "6"
    assert (tmp_path / "a" / "iter_0000003").is_dir()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    # Resume from iteration 3 of the same layout: 4..6 again, bit for bit.
    (tmp_path / "a" / "latest_checkpointed_iteration.txt").write_text("3")
    resumed = torchrun(
        "--pipeline-model-parallel-size", "2", *COMMON, "--load", str(tmp_path / "a"),
        "--save", str(tmp_path / "b"), "--save-interval", "3",
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    again = losses(resumed.stdout)
    assert sorted(again) == [4, 5, 6]
    assert_same_checkpoint(tmp_path / "a" / "iter_0000006", tmp_path / "b" / "iter_0000006")
    # Another pair of plans (TP=2 with sequence parallelism, Megatron schedule) loads the same
    # checkpoint.
    resharded = torchrun(
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--bubble-schedule",
        "megatron",
        *COMMON,
        "--load",
        str(tmp_path / "a"),
    )
    assert resharded.returncode == 0, resharded.stderr[-2000:]
    other = losses(resharded.stdout)
    assert all(abs(other[i] - ref[i]) < 1e-4 for i in (4, 5, 6))


@pytest.mark.slow  # VPP correctness: test_runtime's four-ways test (pp2-vpp2), in make test
def test_interleaved_backbone_trains_and_reshards_to_non_interleaved(tmp_path):
    """--num-layers-per-virtual-pipeline-stage: two model chunks per rank (Optimus schedule);
    its checkpoint resumes on a non-interleaved backbone with the same losses."""
    args = ["--pipeline-model-parallel-size", "2", *COMMON, "--train-iters", "4"]
    vpp = ["--num-layers-per-virtual-pipeline-stage", "1"]
    straight = torchrun(*args, *vpp, "--save", str(tmp_path / "a"), "--save-interval", "2")
    assert straight.returncode == 0, straight.stderr[-2000:]
    assert "PP2 VPP2" in straight.stdout
    ref = losses(straight.stdout)
    (tmp_path / "a" / "latest_checkpointed_iteration.txt").write_text("2")
    resumed = torchrun(*args, "--load", str(tmp_path / "a"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    again = losses(resumed.stdout)
    assert sorted(again) == [3, 4] and all(abs(again[i] - ref[i]) < 1e-5 for i in (3, 4))


def test_kernel_granularity_frozen_encoder_and_online_replanning(tmp_path):
    """--fill-granularity kernel --freeze-ViT --replan-after-iters 1 --overlap-tp-fills
    --sequence-parallel --use-distributed-optimizer --overlap-grad-reduce on TP=2: trains,
    re-plans from measured unit times after the first iteration, the loss falls."""
    out = torchrun(
        "--tensor-model-parallel-size", "2", *COMMON, "--train-iters", "3",
        "--fill-granularity", "kernel", "--freeze-ViT", "--replan-after-iters", "1",
        "--overlap-tp-fills", "--sequence-parallel", "--use-distributed-optimizer",
        "--overlap-grad-reduce",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "frozen: forward only" in out.stdout
    assert "(world size 2), sequence parallel" in out.stdout
    assert "re-planned from measured unit times" in out.stdout
    got = losses(out.stdout)
    assert sorted(got) == [1, 2, 3] and got[3] < got[1]


@pytest.mark.slow  # resumes bit-exact: test_trains_on_llava_conversations... in make test
def test_two_encoders_train_and_resume_from_checkpoint_args(tmp_path):
    """--extra-encoder: a second ViT (half the width, its own resolution) beside the first under
    PP=2 Optimus, with --overlap-grad-reduce; a resume that takes the model from the checkpoint
    (--use-checkpoint-args, no --extra-encoder given) continues bit for bit."""
    second = "num-layers=1,hidden-size=32,num-attention-heads=2,img-h=16,patch-dim=4"
    args = ["--pipeline-model-parallel-size", "2", *COMMON, "--train-iters", "3"]
    args += ["--global-batch-size", "4", "--overlap-grad-reduce", "--ddp-bucket-size", "20000"]
    straight = torchrun(
        *args, "--extra-encoder", second, "--save", str(tmp_path / "a"), "--save-interval", "2"
    )
    assert straight.returncode == 0, straight.stderr[-2000:]
    assert "2 encoders, each colocated" in straight.stdout
    ref = losses(straight.stdout)
    (tmp_path / "a" / "latest_checkpointed_iteration.txt").write_text("2")
    resumed = torchrun(*args, "--load", str(tmp_path / "a"), "--use-checkpoint-args")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    again = losses(resumed.stdout)
    assert sorted(again) == [3] and again[3] == ref[3]


@pytest.mark.slow  # four torchrun jobs
def test_resume_restores_rng_streams_under_dropout(tmp_path):
    """With dropout, a resumed run is bit-identical only if every rank's RNG streams (torch's
    generator for hidden dropout, megatron-core's tracker for attention dropout) come back."""
    args = ["--pipeline-model-parallel-size", "2", *COMMON, "--train-iters", "4"]
    args += ["--hidden-dropout", "0.2", "--attention-dropout", "0.2"]
    resumed_at_2_is_bit_exact(tmp_path, args)


def test_bf16_with_the_distributed_optimizer_trains():
    """A Megatron recipe's precision and memory flags on PP=2 Optimus (bf16, distributed
    optimizer, overlapped reduce and gather, fp32 gradient reduction, full recomputation of
    the backbone and the encoder): the loss falls and no step is skipped."""
    args = ["--pipeline-model-parallel-size", "2", *COMMON, "--train-iters", "8"]
    args += ["--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce"]
    args += ["--overlap-param-gather", "--accumulate-allreduce-grads-in-fp32"]
    args += ["--recompute-granularity", "full", "--recompute-method", "uniform"]
    args += ["--recompute-num-layers", "1", "--recompute-vision"]
    args += ["--timing-log-level", "2", "--timing-log-option", "all"]
    out = torchrun(*args)
    assert out.returncode == 0, out.stderr[-2000:]
    got = losses(out.stdout)
    assert sorted(got) == list(range(1, 9)) and got[8] < got[1]
    iteration_lines = [x for x in out.stdout.splitlines() if " iteration " in x]
    assert "number of skipped iterations:   0" in iteration_lines[-1]
    assert_timing_blocks_add_up(out.stdout, blocks=8, ranks=2)


def assert_timing_blocks_add_up(stdout: str, blocks: int, ranks: int) -> None:
    """--timing-log-level 2 --timing-log-option all: a block under every iteration line whose
    parts (compute, message waits, unhidden communication, host overhead) add up to the step
    on every rank, and every rank's longest waits by message."""
    found = re.findall(r"times across ranks \(ms\):\n((?:    .*\n?)+)", stdout)
    assert len(found) == blocks, stdout[-3000:]
    for block in found:
        timer: dict[str, list[float]] = {}
        for name, values in re.findall(r"    ([a-z-]+):\n((?:     rank .*\n?)+)", block):
            timer[name] = [float(v) for v in re.findall(r"rank +\d+: ([0-9.]+)", values)]
        assert all(len(v) == ranks for v in timer.values()), block
        for r in range(ranks):
            parts = sum(timer[k][r] for k in ("compute", "message-wait", "comm-unhidden"))
            parts += timer["host-overhead"][r]
            assert abs(parts - timer["step"][r]) <= 0.05 * timer["step"][r] + 1.0, block
            assert timer["compute"][r] > 0, block
        waits = re.findall(r"longest message waits \(ms per step\): (.*)", block)
        # by message: receives waited for, or sends being posted (either can be a rank's longest)
        assert len(waits) == ranks and all(re.match(r"(RECV|SEND):", w) for w in waits), block


def test_log_line_counts_nan_and_skipped_iterations():
    """A step whose gradient norm is not finite is skipped (not applied, counted), and a NaN
    loss is counted: here a learning rate of 1e30 makes every step after the first NaN."""
    args = [*COMMON[:2], "--train-iters", "3", "--log-interval", "1", "--lr", "1e30"]
    out = torchrun("--pipeline-model-parallel-size", "2", *args)
    assert out.returncode == 0, out.stderr[-2000:]
    counts = re.findall(
        r"skipped iterations:\s+(\d+) \| number of nan iterations:\s+(\d+)", out.stdout
    )
    assert counts == [("0", "0"), ("1", "1"), ("1", "1")], counts


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--global-batch-size", "7"], "not divisible by --micro-batch-size x DP"),
        (["--load", "/nonexistent/ckpt"], "no latest_checkpointed_iteration.txt"),
        (["--encoder-tensor-model-parallel-size", "1"], "or neither"),
        (["--pipeline-model-parallel-size", "3"], "not divisible by TP 1 x PP 3"),
        (["--data-path", "/nonexistent/data"], "does not exist; an energon LLaVA dataset"),
        (["--tokenizer-model", "/tmp"], "read conversation data: give --data-path"),
        (["--num-layers-per-virtual-pipeline-stage", "1"], "needs --pipeline-model-parallel-size"),
        (["--replan-after-iters", "0"], "--replan-after-iters N needs N >= 1"),
        (["--ddp-bucket-size", "0"], "--ddp-bucket-size 0: give a positive count"),
        (["--lr", "-1"], "--lr -1.0: give a finite number of at least 0.0"),
        (["--lr", "nan"], "--lr nan: give a finite number"),
        (["--min-lr", "1"], "--min-lr 1.0: give a finite number of at least 0.0 and at most"),
        (["--hidden-dropout", "1.5"], "--hidden-dropout 1.5: give a finite number of at least"),
        (["--distributed-timeout-minutes", "0"], "give a positive number of minutes"),
        (["--lr-warmup-iters", "20"], "must be at least 0 and below the LR decay's 20"),
        (["--coreset-pool-ratio", "nan"], "must be between 1 and 64"),
        (["--bf16"], "add --use-distributed-optimizer"),
        (["--bf16", "--fp16"], "--bf16 and --fp16 both given"),
        (["--fp16"], "--fp16 keeps its fp32 main parameters in the distributed optimizer"),
        (["--initial-loss-scale", "0"], "--initial-loss-scale 0.0: give a positive"),
        (["--overlap-param-gather"], "--overlap-param-gather needs --use-distributed-optimizer"),
        (["--use-distributed-optimizer", "--optimizer", "sgd"], "cannot be sharded"),
        (["--recompute-method", "uniform"], "--recompute-method needs --recompute-granularity"),
        (["--recompute-granularity", "full"], "needs --recompute-method uniform|block and"),
        (["--recompute-vision", "--fill-granularity", "kernel"], "use --fill-granularity layer"),
        (["--transformer-impl", "transformer_engine"], "Transformer Engine is not installed"),
        (["--extra-encoder", "num-layers=1,hidden-size=32"], "give num-attention-heads"),
        (["--extra-encoder", "layers=1"], "is not key=value with a key among num-layers"),
        (
            ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "15"],
            "sequence parallelism splits the 31-token sequence",
        ),
        (
            ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"],
            "does not split into PP 2 stages",
        ),
        (["--plan-candidates", "0"], "--plan-candidates 0: give K >= 1"),
        (["--plan-candidates", "1", "--plan-candidate-steps", "1"], "give at least 2"),
        (["--plan-candidates", "1", "--bubble-schedule", "megatron"], "--bubble-schedule optimus"),
        (["--plan-candidates", "1", "--replan-after-iters", "2"], "--replan-after-iters"),
        (["--plan-candidates", "2", "--train-iters", "5"], "ends inside the plan-candidate phase"),
        (  # the split variant a third candidate: 9 warm-up steps, 17 more and a second look's 11
            [*"--plan-candidates 1 --encoder-wgrad-split --train-iters 36".split()],
            "up to 37 iterations for K=1",
        ),
        (  # and the backbone's split a fourth
            [
                *"--plan-candidates 1 --encoder-wgrad-split --backbone-wgrad-split".split(),
                *"--pipeline-model-parallel-size 2 --train-iters 42".split(),
            ],
            "up to 43 iterations for K=1",
        ),  # fmt: skip
    ],
)
def test_bad_arguments_fail_before_any_group(args, msg, monkeypatch):
    refused(args, msg, monkeypatch)


def test_device_connections_other_than_one_are_refused_and_unset_means_one(monkeypatch):
    """megatron-core's overlapped communication and our lazily posted ordered receives are
    scheduled for CUDA_DEVICE_MAX_CONNECTIONS=1: another value is refused before anything
    starts; where it is unset, a rank sets it before its device is touched."""
    from megatron_mllm.runtime.assembly.device_env import device_connections_problem

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    refused([], "CUDA_DEVICE_MAX_CONNECTIONS=8: megatron-core's overlapped", monkeypatch)
    assert device_connections_problem({"CUDA_DEVICE_MAX_CONNECTIONS": "1"}) is None
    assert device_connections_problem({}) is None
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    from megatron_mllm.runtime.assembly.launch import spawn

    assert spawn(_connections_after_init, 1) == ["1"]


def _connections_after_init(rank, world):
    import os

    import torch.distributed as dist

    from megatron_mllm.runtime.assembly.bootstrap import init_rank

    init_rank(rank, world, 0, 60)
    dist.destroy_process_group()
    return os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")


def test_a_refusal_is_one_line_and_exit_2():
    assert_refused_in_one_line(["--global-batch-size", "7"], "not divisible by --micro-batch-size")


@pytest.mark.slow  # the selection itself: tests/test_coreset*.py in make test
@pytest.mark.parametrize(
    "layout",
    [
        ["--pipeline-model-parallel-size", "2"],
        ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    ],
    ids=["pp2", "tp2-sp"],
)
def test_coreset_training_selects_the_same_on_one_or_two_stages(tmp_path, layout):
    """PP=2: the pool goes forward through the pipeline, the last stage selects, every stage
    gets the indices; TP=2: both ranks of the vocabulary-parallel output layer select alike.
    The result must match a one-process run, consumed samples count the pools, and a resumed
    run selects the same (both TP ranks load the selector's state)."""
    args = [
        *COMMON[:2],
        "--train-iters",
        "4",
        "--log-interval",
        "1",
        "--lr",
        "1e-2",
        "--coreset-pool-ratio",
        "2",
        "--coreset-features",
        "zo",
    ]
    one = torchrun(*args, nproc=1)
    two = torchrun(
        *layout,
        *args,
        "--save",
        str(tmp_path / "c"),
        "--save-interval",
        "2",
    )
    assert one.returncode == 0, one.stderr[-2000:]
    assert two.returncode == 0, two.stderr[-2000:]
    a, b = losses(one.stdout), losses(two.stdout)
    assert sorted(a) == [1, 2, 3, 4]
    assert all(abs(a[i] - b[i]) < 1e-4 for i in a)
    assert "consumed samples:           64 |" in two.stdout  # 4 iterations x pools of 16
    from megatron_mllm.training.checkpointing import read_common

    assert read_common(str(tmp_path / "c"))["consumed_samples"] == 64  # as the log says
    # The selector's state (RNG, moments) is in the checkpoint: a resumed run selects the same.
    (tmp_path / "c" / "latest_checkpointed_iteration.txt").write_text("2")
    resumed = torchrun(*layout, *args, "--load", str(tmp_path / "c"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    again = losses(resumed.stdout)
    assert sorted(again) == [3, 4] and all(again[i] == b[i] for i in (3, 4))


def test_trains_on_llava_conversations_validates_and_resumes_exactly(tmp_path, llava_dataset):
    """PP=2 Optimus on the energon LLaVA digits (one loader worker), with dropout: Megatron's
    validation lines with the answers' exact match, truncation reported, and a run resumed at
    iteration 2 continues with the uninterrupted run's losses, tensors and saved RNG streams
    (the loader state is in the checkpoint, and the loader's start draws on no global RNG)."""
    data, tokenizer = llava_dataset
    args = [*LLAVA, "--data-path", str(data), "--tokenizer-model", str(tokenizer),
            "--train-iters", "4", "--eval-interval", "2", "--eval-iters", "1",
            "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]  # fmt: skip
    straight, _, _ = resumed_at_2_is_bit_exact(tmp_path, args)
    a, b = (checkpoint_objects(tmp_path / d / "iter_0000004") for d in ("a", "b"))
    assert a.keys() == b.keys() and any(k.startswith("rng_state") for k in a)
    assert a == b
    assert straight.stdout.count("validation loss at iteration 2 |") == 1
    assert "validation loss at the end of training for val data |" in straight.stdout
    assert re.search(r"answer exact match: [0-9.]+ \(\d+ samples\)", straight.stdout)
    assert "truncated samples: " in straight.stdout
    assert "planned for 1.00 images per sample" in straight.stdout  # the data set's mean


@pytest.mark.slow  # two torchrun jobs; make test runs optimus-adaptive in test_llava_training.py
@pytest.mark.parametrize("per_token", [False, True], ids=["whole-micro-batches", "per-token"])
def test_optimus_adaptive_resumes_with_the_uninterrupted_runs_losses(
    tmp_path, llava_dataset, per_token
):
    """--bubble-schedule optimus-adaptive: every step runs its own plan (the first planned
    before it runs), the loader position saved is the one before the step read ahead, so a
    run resumed at iteration 2 sees the same samples and plans, and the same losses. With
    --calculate-per-token-loss the samples are dealt by images, the same way again."""
    data, tokenizer = llava_dataset
    args = [*LLAVA, "--data-path", str(data), "--tokenizer-model", str(tokenizer),
            "--train-iters", "4", "--global-batch-size", "8", "--bubble-schedule",
            "optimus-adaptive", "--encoder-tensor-model-parallel-size", "1",
            "--encoder-pipeline-model-parallel-size", "1"]  # fmt: skip
    args += ["--calculate-per-token-loss"] if per_token else []
    straight = torchrun(*args, "--save", str(tmp_path / "a"), "--save-interval", "2")
    assert straight.returncode == 0, straight.stderr[-2000:]
    assert "schedule: optimus-adaptive" in straight.stdout
    assert ("its samples dealt by encoder load" in straight.stdout) == per_token
    assert re.search(r"step plans: [1-4] planned, \d+ static fallback", straight.stdout)
    (tmp_path / "a" / "latest_checkpointed_iteration.txt").write_text("2")
    resumed = torchrun(*args, "--load", str(tmp_path / "a"), "--save", str(tmp_path / "b"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    ref = losses(straight.stdout)
    again = losses(resumed.stdout)
    assert set(again) == {3, 4}
    assert all(again[i] == pytest.approx(ref[i], rel=1e-5) for i in (3, 4)), (again, ref)


def test_bad_conversation_arguments_fail_in_one_line(tmp_path, llava_dataset, monkeypatch):
    data, tokenizer = llava_dataset
    hf = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer)]
    cases = [
        (["--data-path", str(tmp_path), *hf], "not a prepared energon dataset"),
        (["--data-path", str(data)], "needs --tokenizer-type HuggingFaceTokenizer"),
        (["--data-path", str(data), *hf, "--image-token", "<im>"], "no image token '<im>'"),
        (["--data-path", str(data), *hf, "--seq-length", "16"], "shorter than one image's 16"),
    ]
    assert_refused_in_one_line(*cases[0])  # the script itself: one line, exit 2
    for args, msg in cases[1:]:
        refused(args, msg, monkeypatch)
    adaptive = ["--bubble-schedule", "optimus-adaptive"]
    refused([*adaptive, "--coreset-pool-ratio", "2"], "optimus-adaptive plans", monkeypatch)
    refused([*adaptive, "--replan-after-iters", "1"], "optimus-adaptive plans", monkeypatch)


@pytest.mark.parametrize(
    "model, world",
    [
        ("vit22b-gpt175b", 3072),
        # the same script with other sizes; make test's budget keeps one of them
        pytest.param("vit11b-llama70b", 1024, marks=pytest.mark.slow),
        pytest.param("vit3b-gpt11b", 256, marks=pytest.mark.slow),
    ],
)
def test_gpu_recipes_pass_argument_checks(model, world):
    """examples/pretrain_paper_gpu.sh with DRY_RUN=1: the paper jobs' arguments are consistent
    (nothing is started; the real run needs GPUs)."""
    env = {**os.environ, "DRY_RUN": "1", "MODEL": model, "PYTHON": sys.executable}
    out = subprocess.run(
        ["bash", str(ROOT / "examples" / "pretrain_paper_gpu.sh")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"arguments checked for world size {world}" in out.stdout
    assert "sequence parallel" in out.stdout  # as Megatron users run TP


def test_the_qwen25_vl_7b_recipe_passes_argument_checks():
    """examples/pretrain_qwen2.5_vl_7b_gpu.sh with DRY_RUN=1 (synthetic data): the shapes and
    plans are consistent."""
    env = {**os.environ, "DRY_RUN": "1", "PYTHON": sys.executable}
    script = ROOT / "examples" / "pretrain_qwen2.5_vl_7b_gpu.sh"
    out = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "arguments checked for world size 32" in out.stdout
    assert "backbone plan: DP8 TP2 PP2, sequence parallel" in out.stdout
    assert "attention in 112-pixel windows but layers 7 15 23 31" in out.stdout
    assert "28 layers x 3584 (7.62B params)" in out.stdout


def test_damaged_shards_are_left_out_within_the_fraction(tmp_path, llava_dataset, monkeypatch):
    """A train shard cut short: refused at the default --max-skipped-samples-fraction (one
    line naming it); within a larger fraction the run starts, warns, and its loader leaves the
    shard out (test_llava_energon reads such a loader)."""
    import shutil

    from megatron_mllm.training.arguments import parse_args
    from megatron_mllm.training.model_args import model_config
    from megatron_mllm.training.run_config import llava_data

    data = shutil.copytree(llava_dataset[0], tmp_path / "data")
    shard = sorted(p.name for p in data.glob("train-*.tar"))[0]
    os.truncate(data / shard, 1000)
    args = [*LLAVA, "--data-path", str(data), "--tokenizer-model", str(llava_dataset[1])]
    refused(args, f"{shard} (", monkeypatch)
    refused([*args, "--max-skipped-samples-fraction", "nan"], "from 0 up to", monkeypatch)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    parsed = parse_args([*args, "--max-skipped-samples-fraction", "0.5"])
    model_config(parsed)
    assert parsed.data_left_out == [shard]
    assert llava_data(parsed).exclude_shards == (shard,)


def test_a_loader_position_fits_only_the_same_damaged_shards():
    """A checkpoint's loader position is dropped (the loader starts anew) when the shards left
    out differ; checkpoints from before data accounting left none out."""
    import argparse

    from megatron_mllm.training.resume import loader_position_fits

    same = {"data_parallel_size": 1, "data_path": "d", "micro_batch_size": 2, "num_workers": 1}
    saved = {**same, "seed": 3, "data_left_out": ["train-000000.tar"]}
    args = argparse.Namespace(**saved)
    assert loader_position_fits(saved, args)
    assert not loader_position_fits({**saved, "data_left_out": []}, args)
    args.data_left_out = []
    assert loader_position_fits({k: v for k, v in saved.items() if k != "data_left_out"}, args)
    assert not loader_position_fits({**saved, "seed": 4}, args)


@pytest.mark.slow  # three torchrun jobs; the selection's pieces run in test_coreset*.py
@pytest.mark.parametrize("lookahead", [[], ["--coreset-lookahead"]], ids=["now", "lookahead"])
def test_coreset_selects_from_energon_pools_and_resumes_exactly(tmp_path, llava_dataset, lookahead):
    """--coreset-pool-ratio 2 on the LLaVA digits, bf16 with the distributed optimizer: each
    step's pool of 2B comes from energon's loader (sources: the records' "source" field) and
    goes forward in bf16, and a run resumed at iteration 2 (loader position and selector state
    in the checkpoint) selects and trains exactly the same; with look-ahead the checkpoint holds
    the position before the next step's pool, read again on resume, and the rows chosen."""
    data, tokenizer = llava_dataset
    args = [*LLAVA, "--data-path", str(data), "--tokenizer-model", str(tokenizer),
            "--train-iters", "4", "--coreset-pool-ratio", "2", "--bf16",
            "--use-distributed-optimizer", *lookahead]  # fmt: skip
    straight, _, _ = resumed_at_2_is_bit_exact(tmp_path, args)
    assert "consumed samples:           16 |" in straight.stdout  # 4 iterations x pools of 8


def test_plan_candidates_train_and_resume_bit_exactly_after_the_phase(tmp_path):
    """--plan-candidates 1 on PP 2: the planner's best and the Megatron schedule (another
    module layout) each train 2 steps after 6 warm-up steps on the first and 3 on the second;
    the table names the one kept; the save at iteration 11 falls inside the phase and is taken
    when it ends (13); resumed from 13, the kept plan trains on (no new phase) with the
    uninterrupted run's losses and iteration-15 tensors, bit for bit."""
    args = ["--pipeline-model-parallel-size", "2", *COMMON, "--train-iters", "15"]
    args += ["--plan-candidates", "1", "--plan-candidate-steps", "2"]
    straight = torchrun(*args, "--save", str(tmp_path / "a"), "--save-interval", "11")
    assert straight.returncode == 0, straight.stderr[-2000:]
    out = straight.stdout
    assert "plan candidates: 2 (" in out and out.count("yes") == 1, out
    assert "the save at iteration 11 fell inside the plan-candidate phase" in out
    assert sorted(p.name for p in (tmp_path / "a").glob("iter_*")) == [
        "iter_0000013",
        "iter_0000015",
    ]
    ref = losses(out)
    assert len(ref) == 15
    (tmp_path / "a" / "latest_checkpointed_iteration.txt").write_text("13")
    resumed = torchrun(*args, "--load", str(tmp_path / "a"), "--save", str(tmp_path / "b"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "the plan the checkpoint's candidate phase kept" in resumed.stdout
    assert "plan candidates: 2 (" not in resumed.stdout
    assert losses(resumed.stdout) == {i: ref[i] for i in (14, 15)}
    assert_same_checkpoint(tmp_path / "a" / "iter_0000015", tmp_path / "b" / "iter_0000015")


@pytest.mark.slow  # a torchrun job stopped from outside
def test_sigterm_to_the_launcher_saves_and_exits_cleanly(tmp_path):
    """--exit-signal-handler: SIGTERM to torchrun (as a cluster pre-empts a job) reaches every
    rank; each finishes its iteration, the run saves it and the ranks exit 0."""
    import signal

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), str(ROOT / "pretrain_mllm.py"),
           "--pipeline-model-parallel-size", "2", *COMMON, "--train-iters", "500",
           "--save", str(tmp_path / "ckpt"), "--exit-signal-handler"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        for line in proc.stdout:
            if re.search(r"iteration\s+3/", line):
                break
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    stopped = re.search(r"SIGTERM received: stopped after iteration (\d+)", out)
    assert stopped, (out[-1500:], err[-1500:])
    it = int(stopped[1])
    assert 3 <= it < 500
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == str(it)
    assert "exitcode" not in err or "exitcode  : 0" in err


@pytest.mark.slow  # a torchrun job on a tmpfs too small for its checkpoint
def test_a_full_disk_is_one_line_and_leaves_no_partial_checkpoint(tmp_path):
    """--save on a 1 MB file system: the first save runs out of space; the run stops with one
    line naming --save and what was needed, and the partial iteration folder is removed."""
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(small)],
                             capture_output=True, text=True)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")
    try:
        out = torchrun(*COMMON, "--train-iters", "2", "--save", str(small / "ckpt"),
                       "--save-interval", "1")  # fmt: skip
        line = [x for x in out.stderr.splitlines() if "no space left on the device" in x]
        assert out.returncode != 0 and line, out.stderr[-3000:]
        assert f"--save {small / 'ckpt'}" in line[0] and "MB needed" in line[0]
        assert not list((small / "ckpt").glob("iter_*"))
        assert not (small / "ckpt" / "latest_checkpointed_iteration.txt").exists()
    finally:
        subprocess.run(["umount", str(small)], capture_output=True)
