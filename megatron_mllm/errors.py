"""One error type for bad configuration, and the CLI convention for reporting it."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """Bad user input. The message is one line: what is wrong and what would be right."""


def exit_on_config_error(main: Callable[..., T]) -> Callable[..., T]:
    """Wrap a CLI main: a ConfigError prints one line to stderr and exits with code 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)

    return wrapper
