"""The resume contract (training/resume_contract.py): what --load and --save refuse, in one line,
before any process group; and that a run whose schedule is overridden continues by it."""

import re

import pytest

from tests.pretrain_runs import assert_refused_in_one_line, refused, torchrun

RUN = ["--global-batch-size", "4", "--lr", "1e-2", "--lr-decay-style", "linear"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 2-iteration run of the tiny default model, saved."""
    root = tmp_path_factory.mktemp("resume") / "ckpt"
    out = torchrun(*RUN, "--train-iters", "2", "--save", str(root), nproc=1)
    assert out.returncode == 0, out.stderr[-2000:]
    return root


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--num-layers", "2"], "holds another model (--num-layers 4; this run: --num-layers 2)"),
        (["--seq-length", "24"], "holds another model (--seq-length"),
        (["--train-iters", "2"], "is at iteration 2, not below --train-iters 2"),
        (
            ["--train-iters", "4"],
            "the LR decay length (--lr-decay-iters, else --train-iters) 2, this run has 4",
        ),
        (["--train-iters", "4", "--lr", "1e-3"], "trained with --lr 0.01, this run has 0.001"),
    ],
)
def test_a_resume_that_cannot_continue_faithfully_is_refused(saved, args, msg, monkeypatch):
    refused([*RUN, "--train-iters", "4", "--load", str(saved), *args], msg, monkeypatch)


def test_save_directories_never_mix_runs(saved, tmp_path, monkeypatch):
    assert_refused_in_one_line(
        [*RUN, "--save", str(saved)], "already holds a run's checkpoints (latest iteration 2)"
    )
    other = tmp_path / "other"
    (other).mkdir()
    (other / "latest_checkpointed_iteration.txt").write_text("9")
    refused(
        [*RUN, "--train-iters", "4", "--override-opt_param-scheduler", "--load", str(saved),
         "--save", str(other)],
        "holds another run's checkpoints (latest iteration 9) than --load",
        monkeypatch,
    )  # fmt: skip
    (tmp_path / "file").write_text("x")
    refused(
        [*RUN, "--save", str(tmp_path / "file" / "ckpt")], "is a file, not a directory", monkeypatch
    )


def test_both_schedule_overrides_are_refused(monkeypatch):
    refused(
        ["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"],
        "both given; choose the side whose LR schedule wins",
        monkeypatch,
    )


def lrs(stdout: str) -> dict[int, float]:
    pattern = r"iteration\s+(\d+)/\s*\d+ \|.*?learning rate: ([0-9.E+-]+) \|"
    return {int(m[1]): float(m[2]) for m in re.finditer(pattern, stdout)}


@pytest.mark.parametrize(
    "side,expected",
    [
        # this run's 4-iteration linear decay from 1e-2: iteration 3 is at step 2 of 4
        ("--override-opt_param-scheduler", {3: 5e-3, 4: 2.5e-3}),
        # the checkpoint's 2-iteration decay has ended: the minimum LR
        pytest.param(
            "--use-checkpoint-opt_param-scheduler", {3: 0.0, 4: 0.0}, marks=pytest.mark.slow
        ),
    ],
)
def test_a_longer_resumed_run_follows_the_side_that_wins(saved, side, expected):
    out = torchrun(*RUN, "--train-iters", "4", "--load", str(saved), side, nproc=1)
    assert out.returncode == 0, out.stderr[-2000:]
    assert lrs(out.stdout) == pytest.approx(expected)


def copy_of(saved, tmp_path):
    import shutil

    shutil.copytree(saved, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def refused_load(root, msg: str, monkeypatch=None) -> None:
    """Refused by the checks (in this process), or, without `monkeypatch`, by the script."""
    args = [*RUN, "--train-iters", "4", "--load", str(root)]
    if monkeypatch is None:
        assert_refused_in_one_line(args, msg)
    else:
        refused(args, msg, monkeypatch)


def test_a_corrupted_or_truncated_checkpoint_file_is_named_before_loading(
    saved, tmp_path, monkeypatch
):
    import os

    root = copy_of(saved, tmp_path)
    shard = root / "iter_0000002" / "__0_1.distcp"  # in rank 0's share of the files
    with open(shard, "r+b") as f:  # 4 KB of random bytes into the middle
        f.seek(shard.stat().st_size // 2)
        f.write(os.urandom(4096))
    refused_load(root, f"checkpoint file {shard} does not match its manifest checksum")
    os.truncate(shard, 1000)
    refused_load(root, f"checkpoint file {shard} has 1000 bytes, the manifest", monkeypatch)
    metadata = root / "iter_0000002" / ".metadata"
    shard.write_bytes((saved / "iter_0000002" / "__0_1.distcp").read_bytes())
    metadata.write_bytes(b"garbage")
    refused_load(root, f"checkpoint file {metadata} has 7 bytes", monkeypatch)


def test_a_directory_mixing_two_runs_is_refused(saved, tmp_path, monkeypatch):
    import json
    import shutil

    root = copy_of(saved, tmp_path)
    shutil.copytree(root / "iter_0000002", root / "iter_0000001")
    held = json.loads((root / "iter_0000001" / "manifest.json").read_text())
    held["run_id"] = "another-run"
    (root / "iter_0000001" / "manifest.json").write_text(json.dumps(held))
    refused_load(
        root, "mixes checkpoints of 2 runs (iter_0000001 and iter_0000002 differ)", monkeypatch
    )


def test_consumed_samples_carry_on_from_the_checkpoint_across_a_batch_size_change():
    """Saved at iteration 2 by a run of global batch 8 (16 samples); resumed with 16 a step:
    iteration 3 has consumed 32, not 3 x 16 (Megatron carries the count forward)."""
    from types import SimpleNamespace

    from megatron_mllm.training.resume import consumed_samples

    args = SimpleNamespace(global_batch_size=16, coreset=None)
    assert consumed_samples(args, 3, since=(2, 16)) == 32
    assert consumed_samples(args, 3) == 48  # a run that started here
    pools = SimpleNamespace(global_batch_size=8, coreset=SimpleNamespace(pool_ratio=2.0))
    assert consumed_samples(pools, 4, since=(2, 40)) == 40 + 2 * 16


@pytest.mark.slow  # two torchrun jobs
def test_a_resume_with_another_global_batch_logs_the_carried_count(tmp_path):
    from tests.pretrain_runs import COMMON, torchrun

    args = [*COMMON, "--train-iters", "2", "--save", str(tmp_path / "a")]
    first = torchrun(*args)
    assert first.returncode == 0, first.stderr[-2000:]
    resumed = torchrun(  # the later --global-batch-size wins
        *COMMON, "--train-iters", "3", "--global-batch-size", "16", "--load", str(tmp_path / "a"),
        "--override-opt_param-scheduler",
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "consumed samples:           32 |" in resumed.stdout, resumed.stdout[-800:]


def test_a_different_tokenizer_is_refused_on_resume(tmp_path, llava_dataset, monkeypatch):
    """The checkpoint records its tokenizer (files and image token); a resume with another,
    even one padding to the same vocabulary, is refused unless --allow-tokenizer-change."""
    import shutil

    import torch

    from megatron_mllm.data.tokenizer import tokenizer_identity
    from tests.pretrain_runs import refused
    from tests.test_checkpoint_safety import METADATA_JSON

    data, tokenizer = llava_dataset
    other = tmp_path / "other_tokenizer"
    shutil.copytree(tokenizer, other)
    config = other / "tokenizer.json"
    config.write_text(config.read_text().replace('"<image>"', '"<image>"', 1) + " ")
    root = tmp_path / "ckpt"
    (root / "iter_0000002").mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("2")
    (root / "iter_0000002" / "metadata.json").write_text(METADATA_JSON)
    (root / "iter_0000002" / "manifest.json").write_text('{"run_id": "r", "files": {}}')
    common = {"iteration": 2, "args": {}, "tokenizer": tokenizer_identity(tokenizer)}
    torch.save({"common": common}, root / "iter_0000002" / "common.pt")
    args = ["--load", str(root), "--data-path", str(data), "--tokenizer-type",
            "HuggingFaceTokenizer", "--train-iters", "6"]  # fmt: skip
    refused([*args, "--tokenizer-model", str(other)], "trained with another tokenizer", monkeypatch)
    refused([*args, "--tokenizer-model", str(tokenizer), "--image-token", "<pad>"],
            "(image token differ", monkeypatch)  # fmt: skip
