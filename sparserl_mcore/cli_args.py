"""What every `sparserl` command's argument parsing shares: one-line errors and checked numbers.

`ArgumentParser` answers a bad command line in one line (`sparserl X: error: ... (see sparserl X
--help)`) instead of argparse's usage block; the subcommand parsers of a command inherit it. The
`type=` helpers refuse a number outside the range its consumer accepts while the line is parsed,
naming the flag and the value (argparse prefixes the flag):

    parser.add_argument("--tp", type=positive_int)        # --tp 0 -> "argument --tp: 0: must be >= 1"
"""

from __future__ import annotations

import argparse
import math
from typing import NoReturn


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors; `--help` is where the usage is."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def positive_int(text: str) -> int:
    """An integer >= 1 (ranks, sizes, counts)."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be >= 1")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0 (versions, counts where 0 means none)."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value}: must be >= 0")
    return value


def port(text: str) -> int:
    """A TCP port, 1..65535."""
    value = _int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value}: must be a TCP port (1..65535)")
    return value


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text}: give a finite number")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (seconds, learning rates)."""
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value:g}: must be > 0")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (seconds where 0 means none)."""
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value:g}: must be >= 0")
    return value
