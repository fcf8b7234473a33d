"""Plain-text tables for the CLI and the benchmarks. No dependency.

>>> print(table(["plan", "peak", "fits"], [["micro 8 x 4", 1234, True], ["micro 4 x 8", 99, False]]))
plan         peak  fits
-----------  ----  ----
micro 8 x 4  1234  yes
micro 4 x 8    99  no
"""

from __future__ import annotations

from collections.abc import Sequence


def cell(value) -> str:
    """The text of one cell: booleans as yes/no, None as "-", floats with 4 significant digits."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def table(headers: Sequence[str], rows: Sequence[Sequence], *, align: str | None = None,
          indent: str = "", gap: str = "  ") -> str:
    """Columns padded to their widest cell, a dashed rule under the headers, no trailing spaces.

    `align` has one letter per column, "l" or "r"; by default a column whose cells are all numbers
    is right-aligned and any other is left-aligned.
    """
    headers = [str(h) for h in headers]
    width = len(headers)
    for i, row in enumerate(rows):
        if len(row) != width:
            raise ValueError(f"row {i} has {len(row)} cells but there are {width} headers ({headers}).")
    if align is None:
        align = "".join("r" if rows and all(_is_number(r[c]) or r[c] is None for r in rows) else "l"
                        for c in range(width))
    elif len(align) != width or set(align) - {"l", "r"}:
        raise ValueError(f"align must have one 'l' or 'r' per column ({width}) but got {align!r}.")
    texts = [[cell(v) for v in row] for row in rows]
    widths = [max([len(headers[c])] + [len(t[c]) for t in texts]) for c in range(width)]

    def line(cells):
        parts = [c.rjust(w) if a == "r" else c.ljust(w) for c, w, a in zip(cells, widths, align)]
        return (indent + gap.join(parts)).rstrip()

    out = [line(headers), line(["-" * w for w in widths])]
    out += [line(t) for t in texts]
    return "\n".join(out)


def key_values(pairs: Sequence[tuple[str, object]], *, indent: str = "") -> str:
    """'name   value' lines with the names padded to the longest one."""
    pairs = list(pairs)
    if not pairs:
        return ""
    pad = max(len(k) for k, _ in pairs)
    return "\n".join(f"{indent}{k.ljust(pad)}  {cell(v)}".rstrip() for k, v in pairs)
