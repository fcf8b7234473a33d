"""`autofit cache list | show KEY | clear`: the plans that worked."""

from __future__ import annotations

import json
import sys

from autofit.sizes import format_size
from autofit.commands import EXIT_DOES_NOT_FIT, EXIT_OK, UsageError, out


def _cache():
    from autofit.cache.store import PlanCache
    return PlanCache()


def _short_class(fields: dict) -> str:
    model = fields.get("model")
    name = model.get("class") if isinstance(model, dict) else None
    return name.rsplit(".", 1)[-1] if isinstance(name, str) else None


def _device_name(fields: dict) -> str | None:
    device = fields.get("device")
    return device.get("name") if isinstance(device, dict) else None


def cmd_cache_list(args) -> int:
    from autofit.plans.plan import Plan
    from autofit.diagnosis.report import table
    cache = _cache()
    entries = cache.entries()
    out(f"plan cache: {cache.path}")
    if not entries:
        out("no cached plans")
        return EXIT_OK
    rows = []
    for e in entries:
        fields, entry = e["fields"], e["entry"]
        proven = entry.get("proven_row_elements")  # the longest rows the plan was proven on
        rows.append([e["key"][:12], _short_class(fields), fields.get("global_batch"), _device_name(fields),
                     Plan.from_dict(entry["plan"]).describe(), format_size(entry["peak_bytes"]),
                     "any" if proven is None else proven, entry["when"][:19].replace("T", " ")])
    out(table(["key", "model", "global batch", "device", "plan", "peak", "row elements", "when (UTC)"],
              rows))
    return EXIT_OK


def cmd_cache_show(args) -> int:
    cache = _cache()
    matches = [e for e in cache.entries() if e["key"].startswith(args.key)]
    if not matches:
        print(f"autofit: error: no cached plan has a key starting with {args.key!r} in {cache.path}; "
              f"`autofit cache list` shows the keys.", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    exact = [e for e in matches if e["key"] == args.key]
    if len(matches) > 1 and not exact:
        raise UsageError(f"{len(matches)} cached plans have a key starting with {args.key!r}; give "
                         f"more of the key.")
    out(json.dumps((exact or matches)[0], indent=2, sort_keys=True))
    return EXIT_OK


def cmd_cache_clear(args) -> int:
    cache = _cache()
    removed = cache.clear()
    out(f"removed {removed} cached plan(s) from {cache.path}")
    return EXIT_OK
