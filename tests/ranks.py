"""pretrain_mllm.py's main in rank processes forked from the launcher's preloaded server
(runtime/assembly/launch.py): what torchrun would run, without its seconds of start-up per rank. The
tests about the launcher itself (its signals, a killed rank) use real torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path


def _main_in_rank(
    rank: int, world: int, argv: list[str], env: dict, out_dir: str, faults=None
) -> int:
    """One rank: its environment, its stdout and stderr into files, train.main(argv, faults)."""
    os.environ.update(env)
    out = Path(out_dir)
    for fd, name in ((1, f"rank{rank}.out"), (2, f"rank{rank}.err")):
        f = open(out / name, "w")  # noqa: SIM115 - the rank's descriptor lives as long as it
        os.dup2(f.fileno(), fd)
    from megatron_mllm.training.train import main

    try:
        code = main(argv, faults)
    except SystemExit as err:
        code = err.code if isinstance(err.code, int) else 1
    except Exception:  # noqa: BLE001 - what a crashed rank would print
        traceback.print_exc()
        code = 1
    _release_save_locks()  # a forked rank ends with os._exit: what its exit would release
    sys.stdout.flush()
    sys.stderr.flush()
    return int(code or 0)


def _release_save_locks() -> None:
    """The --save locks this rank holds, released as its interpreter's exit would (atexit)."""
    from megatron_mllm.training import save_lock

    for path in list(save_lock._held):
        save_lock.release(Path(path))


def pretrain(
    *args: str, nproc: int = 2, env: dict | None = None, timeout_s: float = 300, faults=None
):
    """Run pretrain_mllm.py's main with `args` on `nproc` ranks (`faults`: a FaultHooks to
    inject); a CompletedProcess with every rank's stdout (and stderr) in rank order and the
    first non-zero exit code."""
    from megatron_mllm.runtime.assembly.launch import spawn

    with tempfile.TemporaryDirectory() as out_dir:
        codes = spawn(
            _main_in_rank,
            nproc,
            [str(a) for a in args],
            dict(env or {}),
            out_dir,
            faults,
            timeout_s=timeout_s,
            allow_failures=True,
        )
        out = "".join((Path(out_dir) / f"rank{r}.out").read_text() for r in range(nproc))
        err = "".join((Path(out_dir) / f"rank{r}.err").read_text() for r in range(nproc))
    for code in codes:
        if not isinstance(code, int):  # the launcher's report of a rank that gave none
            err += f"\n{code}"
    rc = next((c if isinstance(c, int) else 1 for c in codes if c != 0), 0)
    return subprocess.CompletedProcess(["pretrain_mllm.py", *map(str, args)], rc, out, err)
