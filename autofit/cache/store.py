"""The plan cache: plans that worked, per job and device, in one SQLite file holding JSON.

Caches are data, never code: rows are JSON and are checked before use (`_check_entry`). The file
itself (ours or moved aside, shared with optuna, safe across threads and processes) is
`autofit.cache.sqlite_file`'s; rows are written with upserts.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from datetime import datetime, timezone

from autofit.cache.sqlite_file import CacheFile, _write_transaction, logger
from autofit.plans.plan import Plan

FILE_NAME = "plans.sqlite"
ENV_DIR = "AUTOFIT_CACHE_DIR"
_ENTRY_NUMBERS = ("calibration", "throughput")


def default_path() -> pathlib.Path:
    """`$AUTOFIT_CACHE_DIR/plans.sqlite`, else `plans.sqlite` in the user cache directory."""
    directory = os.environ.get(ENV_DIR)
    if directory:
        return pathlib.Path(directory).expanduser() / FILE_NAME
    import platformdirs  # only needed without the environment variable

    return pathlib.Path(platformdirs.user_cache_dir("autofit")) / FILE_NAME


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def _check_entry(entry) -> str | None:
    """Why `entry` is not a valid cache entry, or None when it is."""
    if not isinstance(entry, dict):
        return f"the entry must be a dict but got {type(entry).__name__}"
    missing = [k for k in ("plan", "peak_bytes", *_ENTRY_NUMBERS) if k not in entry]
    if missing:
        return f"the entry lacks {missing}"
    if not isinstance(entry["plan"], dict):
        return f"entry['plan'] must be a dict (Plan.to_dict()) but got {type(entry['plan']).__name__}"
    try:
        Plan.from_dict(entry["plan"])
    except (TypeError, ValueError) as e:
        return f"entry['plan'] is not a valid Plan ({e})"
    peak = entry["peak_bytes"]
    if isinstance(peak, bool) or not isinstance(peak, int) or peak < 0:
        return f"entry['peak_bytes'] must be a non-negative int but got {peak!r}"
    for name in _ENTRY_NUMBERS:
        value = entry[name]
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value)):
            return f"entry[{name!r}] must be a finite number or None but got {value!r}"
    return None


class PlanCache(CacheFile):
    """Plans keyed by `fingerprint.job_key`; values are JSON entries.

    An entry is {"plan": Plan.to_dict(), "peak_bytes": int, "calibration": float | None,
    "throughput": float | None, "when": ISO-8601 UTC}; `put` sets "when". Reading never creates
    the file; writing creates it and its parent directories.
    """

    def __init__(self, path: str | os.PathLike | None = None):
        if path is None:
            path = default_path()
        elif not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str, an os.PathLike or None but got "
                            f"{type(path).__name__} {path!r}.")
        self.path = pathlib.Path(path).expanduser()
        if self.path.is_dir():
            raise ValueError(f"the plan cache path {str(self.path)!r} is a directory; pass a file "
                             f"path such as {str(self.path / FILE_NAME)!r}.")

    def __repr__(self) -> str:
        return f"PlanCache({str(self.path)!r})"

    def __enter__(self) -> "PlanCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Nothing is held between calls; kept so callers can treat the cache as a resource."""

    # --- reading -------------------------------------------------------------------------------

    def _decode(self, key: str, fields_text: str, entry_text: str) -> dict | None:
        try:
            fields = json.loads(fields_text)
            entry = json.loads(entry_text)
        except (TypeError, ValueError) as e:
            logger.warning("plan cache %s: row %s is not valid JSON (%s); ignoring it.", self.path, key, e)
            return None
        problem = _check_entry(entry)
        if problem is None and not isinstance(entry.get("when"), str):
            problem = "the entry lacks 'when'"
        if problem is None and not isinstance(fields, dict):
            problem = f"its fields must be a JSON object but are {type(fields).__name__}"
        if problem is not None:
            logger.warning("plan cache %s: row %s is invalid (%s); ignoring it.", self.path, key, problem)
            return None
        return {"key": key, "fields": fields, "entry": entry}

    def get(self, key: str) -> dict | None:
        """The stored entry for `key`, or None (missing, unreadable or invalid)."""
        _check_key(key)

        def action(conn):
            row = conn.execute("SELECT key, fields, entry FROM plans WHERE key = ?", (key,)).fetchone()
            return None if row is None else self._decode(*row)

        found = self._run(False, action, None)
        return None if found is None else found["entry"]

    def get_plan(self, key: str) -> Plan | None:
        """The stored Plan for `key`, or None."""
        entry = self.get(key)
        return None if entry is None else Plan.from_dict(entry["plan"])  # validated by get

    def entries(self) -> list[dict]:
        """Every valid row as {"key", "fields", "entry"}, newest first."""
        def action(conn):
            rows = conn.execute("SELECT key, fields, entry FROM plans ORDER BY written DESC, key")
            return [d for d in (self._decode(*row) for row in rows) if d is not None]

        return self._run(False, action, [])

    # --- writing -------------------------------------------------------------------------------

    def ensure(self) -> bool:
        """Make the file (our table and marks) if it does not exist yet, so another tool can share
        it: `autofit.tune` opens its optuna study here (`sqlite:///<path>`). True when the file is
        a usable cache afterwards."""
        return self._run(True, lambda conn: True, False)

    def put(self, key: str, fields: dict, entry: dict) -> None:
        """Store (or replace) the entry for `key`; "when" is set to now (UTC)."""
        _check_key(key)
        if not isinstance(fields, dict):
            raise TypeError(f"fields must be a dict (from job_key) but got {type(fields).__name__}.")
        problem = _check_entry(entry)
        if problem is not None:
            raise ValueError(f"cannot cache {entry!r:.200}: {problem}.")
        written = _now()
        try:
            fields_text = json.dumps(fields, sort_keys=True, allow_nan=False)
            entry_text = json.dumps({**entry, "when": written}, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"cache fields and entry must be plain JSON data: {e}.") from None

        def action(conn):
            with _write_transaction(conn):
                conn.execute(
                    "INSERT INTO plans (key, fields, entry, written) VALUES (?, ?, ?, ?) "
                    "ON CONFLICT(key) DO UPDATE SET fields = excluded.fields, "
                    "entry = excluded.entry, written = excluded.written",
                    (key, fields_text, entry_text, written))

        self._run(True, action, None)

    def clear(self) -> int:
        """Remove every row; the number removed."""
        def action(conn):
            with _write_transaction(conn):
                return conn.execute("DELETE FROM plans").rowcount

        return self._run(False, action, 0)


def _check_key(key) -> None:
    if not isinstance(key, str) or not key:
        raise ValueError(f"key must be a non-empty string (from job_key) but got {key!r}.")
