"""Bad configuration, a run that must stop, and the CLI convention for reporting them."""

from __future__ import annotations

import argparse
import functools
import os
import sys
import traceback
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def flag(dest: str) -> str:
    """An argument's dest as the flag a message names: min_lr -> --min-lr."""
    return "--" + dest.replace("_", "-")


class ConfigError(ValueError):
    """Bad user input. The message is one line: what is wrong and what would be right."""


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (and exit code 2), like every bad input."""

    def error(self, message: str):
        print(f"error: {message}; see --help", file=sys.stderr)
        sys.exit(2)


class RunStopped(RuntimeError):
    """A run that cannot go on safely (e.g. NaN steps in a row). One line: what happened and
    what state is kept."""


def exit_on_config_error(main: Callable[..., T]) -> Callable[..., T]:
    """Wrap a CLI main: a ConfigError prints one line to stderr and exits with code 2, a
    RunStopped one line and code 3; any other error its traceback, then one line naming the
    rank and the error, and code 1."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)
        except RunStopped as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(3)
        except Exception as err:  # anything else: its traceback, then one line that sums it up
            traceback.print_exc()
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            where = f"rank {os.environ['RANK']}: " if "RANK" in os.environ else ""
            print(f"error: {where}{type(err).__name__}: {first} (traceback above)", file=sys.stderr)
            sys.exit(1)

    return wrapper
