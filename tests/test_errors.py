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
