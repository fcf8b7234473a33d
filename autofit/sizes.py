"""Byte sizes: parse "2GiB" / "512MiB" / "2GB" / plain ints, and format them back."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str) -> int:
    """Bytes from a size: an int, or a string such as "2GiB", "512MiB", "1.5GiB", "2GB" (decimal).

    Bare "G"/"M"/"K" are binary, as in nvidia-smi and PyTorch's messages.
    """
    if isinstance(value, bool):
        raise TypeError(f"size must be an int or a string like '2GiB' but got {value!r}.")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"size must be positive but got {value!r}; pass e.g. '2GiB' or 2147483648.")
        return value
    if isinstance(value, float):
        if value <= 0 or value != value or value == float("inf"):
            raise ValueError(f"size must be a positive finite number but got {value!r}.")
        if value < 1:
            raise ValueError(f"size must be at least 1 byte but got {value!r}.")
        return int(value)
    if not isinstance(value, str):
        raise TypeError(f"size must be an int or a string like '2GiB' but got {type(value).__name__} "
                        f"{value!r}.")
    match = _PATTERN.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"cannot read the size {value!r}; use a number with an optional unit, "
                         f"e.g. '2GiB', '512MiB', '2GB' or '1073741824'.")
    number = float(match.group(1)) * _UNITS[unit]
    if number < 1:
        raise ValueError(f"size must be at least 1 byte but got {value!r}.")
    return int(number)


def format_size(nbytes: int | float) -> str:
    """'1.50 GiB'-style text, as in PyTorch's OOM messages."""
    sign = "-" if nbytes < 0 else ""
    nbytes = abs(nbytes)
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{sign}{nbytes / scale:.2f} {unit}"
    return f"{sign}{int(nbytes)} bytes"


def format_breakdown(breakdown: dict, budget: int | None = None) -> str:
    """"1.2 GiB of a 2 GiB budget (params 400 MiB, grads ...)": bytes by kind, for messages."""
    parts = [f"{k} {format_size(v)}" for k, v in breakdown.items()]
    total = sum(breakdown.values())
    tail = f" of a {format_size(budget)} budget" if budget else ""
    return f"{format_size(total)}{tail} ({', '.join(parts)})"
