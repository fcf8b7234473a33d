"""What the command-line commands share: exit statuses, usage errors, option checks, output.

A command is a function `args -> exit status` (autofit.cli wires them to the parser).
"""

from __future__ import annotations

import sys

from autofit.errors import UsageError
from autofit.sizes import format_size, parse_size

EXIT_OK = 0
EXIT_DOES_NOT_FIT = 1
EXIT_USAGE = 2
EXIT_INTERNAL = 3
EXIT_INTERRUPTED = 130


def size_arg(option: str, text: str, allow_zero: bool = False) -> int:
    if allow_zero and text.strip() in ("0", "0B", "0b"):
        return 0
    try:
        return parse_size(text)
    except (TypeError, ValueError) as e:
        raise UsageError(f"{option} {text!r}: {e}") from None


def positive_arg(option: str, value: int) -> int:
    if value < 1:
        raise UsageError(f"{option} must be a positive integer but got {value}.")
    return value


def out(text: str = "") -> None:
    print(text, file=sys.stdout)


def attempts_table(attempts) -> None:
    from autofit.diagnosis.report import table
    rows = [[a.step, a.plan.describe(), a.outcome, format_size(a.peak_bytes) if a.peak_bytes else None,
             a.reason] for a in attempts]
    out(table(["step", "plan", "outcome", "peak", "reason"], rows, align="rllrl"))
