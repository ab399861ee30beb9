"""pretrain_mllm.py runs for the tests: under forked ranks or torchrun, their losses, their
checkpoints compared, resumes checked bit-exact, and refusals checked to be one line."""

import os
import re
import subprocess
import sys

import pytest
import torch

from megatron_mllm.runtime.assembly.launch import free_port
from tests.conftest import ROOT

COMMON = [
    "--global-batch-size",
    "8",
    "--train-iters",
    "6",
    "--log-interval",
    "1",
    "--lr",
    "1e-2",
    "--lr-decay-style",
    "constant",
]


def torchrun(*args, nproc=2, env: dict | None = None, launcher: bool = False, faults=None):
    """pretrain_mllm.py on `nproc` ranks: its main in forked rank processes (tests/ranks.py,
    `faults` a FaultHooks to inject), or with `launcher` under real torchrun (for what is
    about the launcher)."""
    if not launcher:
        from tests.ranks import pretrain

        return pretrain(*args, nproc=nproc, env=env, faults=faults)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-port",
        str(free_port()),
        str(ROOT / "pretrain_mllm.py"),
        *args,
    ]
    env = {**os.environ, **env} if env else None
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)


def losses(stdout: str) -> dict[int, float]:
    out = {}
    for m in re.finditer(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+) \|", stdout):
        out[int(m[1])] = float(m[2])
    return out


def _tensor_pairs(a, b):
    """(name, tensor in a, tensor in b) for every tensor of two checkpoints holding the same
    names."""
    from megatron_mllm.runtime.assembly.launch import spawn
    from megatron_mllm.training.checkpointing import plain_tensors

    x, y = (spawn(plain_tensors, 1, str(p))[0] for p in (a, b))
    assert set(x) == set(y) and len(x) > 10
    return [(name, t, y[name]) for name, t in x.items() if hasattr(t, "shape")]


def checkpoint_objects(path) -> dict:
    """Every non-tensor object a torch_dist checkpoint holds (RNG streams, loader positions),
    as comparable plain data (tensors as lists)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    import megatron_mllm.training.checkpointing  # noqa: F401  (the safe loading)

    meta = FileSystemReader(str(path)).read_metadata()
    keys = [k for k, v in meta.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]
    state = dict.fromkeys(keys)
    dcp.load(state, checkpoint_id=str(path), no_dist=True)

    def plain(x):
        if isinstance(x, torch.Tensor):
            return x.tolist()
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        return x

    return {k: plain(v) for k, v in state.items()}


def assert_same_checkpoint(a, b) -> None:
    """Bit for bit: the same tensors (weights and optimizer moments) in both checkpoints."""
    for name, x, y in _tensor_pairs(a, b):
        assert torch.equal(x, y), name


def assert_close_checkpoint(a, b, atol: float) -> None:
    """The same tensors in both checkpoints, equal within `atol` (another DP size or optimizer
    sums the gradients in another order)."""
    for name, x, y in _tensor_pairs(a, b):
        assert torch.allclose(x, y, atol=atol, rtol=0), name


def resumed_at_2_is_bit_exact(tmp_path, args: list[str]):
    """Four iterations saved at 2 and 4 in `a`; resumed from 2 into `b`: the same losses and
    the same iteration-4 tensors. Returns (straight run, resumed run, straight losses)."""
    straight = torchrun(*args, "--save", str(tmp_path / "a"), "--save-interval", "2")
    assert straight.returncode == 0, straight.stderr[-2000:]
    ref = losses(straight.stdout)
    (tmp_path / "a" / "latest_checkpointed_iteration.txt").write_text("2")
    resumed = torchrun(*args, "--load", str(tmp_path / "a"), "--save", str(tmp_path / "b"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert losses(resumed.stdout) == {i: ref[i] for i in (3, 4)}
    assert_same_checkpoint(tmp_path / "a" / "iter_0000004", tmp_path / "b" / "iter_0000004")
    return straight, resumed, ref


def refused(args: list[str], msg: str, monkeypatch, world: int = 2) -> None:
    """pretrain_mllm.py's argument checks (in this process, as rank 0 of `world`) refuse
    `args` with one line holding `msg` (`assert_refused_in_one_line` runs the script itself)."""
    from megatron_mllm.errors import ConfigError
    from megatron_mllm.training.arguments import parse_args
    from megatron_mllm.training.model_args import model_config

    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError) as err:
        model_config(parse_args(args))  # what main checks before anything starts
    assert msg in str(err.value) and "\n" not in str(err.value), str(err.value)


def assert_refused_in_one_line(args: list[str], msg: str) -> None:
    """pretrain_mllm.py with `args` (as rank 0 of 2) exits 2 with one line holding `msg`."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "pretrain_mllm.py"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={"WORLD_SIZE": "2", "RANK": "0", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 2, proc.stderr
    assert msg in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


LLAVA = [
    "--pipeline-model-parallel-size", "2", "--micro-batch-size", "2", "--global-batch-size",
    "4", "--seq-length", "64", "--tokenizer-type", "HuggingFaceTokenizer", "--num-workers",
    "1", "--log-interval", "1", "--lr", "3e-3", "--lr-decay-style", "constant",
]  # fmt: skip


def assert_trains_as_without(args: list[str], flag: str, *said: str) -> None:
    """pretrain_mllm.py with `args` and `flag` says each of `said` and logs the losses of the
    same run without `flag` (three iterations)."""
    with_flag, plain = torchrun(*args, flag), torchrun(*args)
    assert with_flag.returncode == 0 and plain.returncode == 0, with_flag.stderr[-2000:]
    assert all(line in with_flag.stdout for line in said), with_flag.stdout
    a, b = losses(with_flag.stdout), losses(plain.stdout)
    assert a.keys() == b.keys() == {1, 2, 3}
    assert all(a[i] == pytest.approx(b[i], rel=1e-4) for i in a), (a, b)
