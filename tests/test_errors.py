"""The CLI convention (errors.exit_on_config_error): one line per error, the exit code says
which kind."""

import pytest

from megatron_mllm.errors import ConfigError, RunStopped, exit_on_config_error


@pytest.mark.parametrize(
    "error,code,line",
    [
        (ConfigError("--lr -1.0: give a number"), 2, "error: --lr -1.0: give a number"),
        (RunStopped("3 NaN iterations in a row"), 3, "error: 3 NaN iterations in a row"),
        (RuntimeError("peer rank 1 failed\nmore"), 1, "error: rank 0: RuntimeError: peer rank 1 "
         "failed (traceback above)"),
    ],
)  # fmt: skip
def test_each_error_ends_in_one_line_with_its_exit_code(error, code, line, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")

    @exit_on_config_error
    def main():
        raise error

    with pytest.raises(SystemExit) as stop:
        main()
    assert stop.value.code == code
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == line
    assert (len(err) == 1) == (code != 1)  # only an unexpected error keeps its traceback


def test_bad_inputs_are_one_line(tmp_path):
    """A binary tracker, a JSONL file broken on its third line (named), a conversion whose
    --output-dir another conversion filled meanwhile."""
    from megatron_mllm.data.energon_llava import _move_into_place
    from megatron_mllm.data.llava import load_raw
    from megatron_mllm.training.checkpointing import TRACKER, latest_iteration, tracked

    (tmp_path / TRACKER).write_bytes(b"\xff\xfe\x00garbage")
    for read in (lambda: latest_iteration(str(tmp_path)), lambda: tracked(tmp_path)):
        with pytest.raises(ConfigError, match="is not an iteration number") as err:
            read()
        assert "\n" not in str(err.value)
    data = tmp_path / "data.jsonl"
    data.write_text('{"id": 1}\n\n{"id": 2\n{"id": 3}\n')
    with pytest.raises(ConfigError, match=r"data.jsonl: not JSON \(line 3: "):
        load_raw(data)
    mine, out = tmp_path / "out.partial-1", tmp_path / "out"
    mine.mkdir()
    out.mkdir()
    (out / "theirs.tar").write_text("x")
    with pytest.raises(ConfigError, match="another conversion wrote it while this one ran"):
        _move_into_place(mine, out)
    assert (out / "theirs.tar").read_text() == "x"
