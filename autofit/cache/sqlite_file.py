"""The plan cache's file: one SQLite file that is ours, shared safely, or moved aside.

A file that is not SQLite, or SQLite without our application id / schema version, is reported,
moved aside to `<name>.corrupt-<timestamp>` and ignored. One exception: a file holding only
optuna's tables (`autofit.tune` keeps its optuna study in this file, and optuna may have made it
first) gets our table and marks added, and optuna's tables are never touched. Each call opens its
own short-lived connection, so the file is safe to share between threads, and several processes may
write at once (WAL, `BEGIN IMMEDIATE` transactions, a busy timeout). `autofit.cache.store.PlanCache`
keeps its rows in it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import time
from datetime import datetime, timezone

logger = logging.getLogger("autofit.cache.store")  # the plan cache's records, wherever they start

APPLICATION_ID = 0x61667431  # "aft1": marks the file as ours, unlike user_version alone
SCHEMA_VERSION = 1
BUSY_TIMEOUT_S = 30.0
_SCHEMA = """
CREATE TABLE plans (
    key     TEXT PRIMARY KEY,
    fields  TEXT NOT NULL,
    entry   TEXT NOT NULL,
    written TEXT NOT NULL
)
"""
_COLUMNS = ["key", "fields", "entry", "written"]
# Tables optuna's RDB storage makes (optuna 3.x-5.x, `optuna.storages._rdb.models` plus alembic's).
# `autofit.tune` keeps its study in the plan cache file, and when optuna made the file first it has
# these tables and no marks of ours: such a file is shared, not foreign.
OPTUNA_TABLES = frozenset({
    "alembic_version", "studies", "study_directions", "study_system_attributes",
    "study_user_attributes", "trial_heartbeats", "trial_intermediate_values", "trial_params",
    "trial_system_attributes", "trial_user_attributes", "trial_values", "trials", "version_info",
})


class _Unusable(Exception):
    """The file is not a cache of ours; `.reason` says why, `.move` whether to move it aside."""

    def __init__(self, reason: str, move: bool = True):
        super().__init__(reason)
        self.reason = reason
        self.move = move


def _is_corruption(error: sqlite3.DatabaseError) -> bool:
    # SQLITE_CORRUPT (11) and SQLITE_NOTADB (26) raise the base DatabaseError; locks, I/O and
    # permission problems raise OperationalError and must not get a good file moved aside.
    return type(error) is sqlite3.DatabaseError


class CacheFile:
    """Opening, checking and moving aside `self.path`; `_run(create, action, default)` runs
    `action(connection)` on a usable file. Subclasses set `path`."""

    def _connect(self, create: bool) -> sqlite3.Connection | None:
        """A connection to a usable cache, or None when reading and there is none.

        A corrupt or foreign file is reported and moved aside; when `create`, a fresh file then
        takes its place.
        """
        for _ in range(2):  # a second pass after moving a bad file aside
            if create:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                uri = self.path.absolute().as_uri() + "?mode=rwc"
            elif not self.path.exists():
                return None
            else:  # never creates the file; read-only after a write-protected file refused rw
                uri = self.path.absolute().as_uri() + getattr(self, "_read_mode", "?mode=rw")
            identity = self._identity()
            try:
                conn = sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_S, isolation_level=None)
            except sqlite3.OperationalError:
                if not create and not self.path.exists():
                    return None  # removed between the check and the open
                raise
            try:
                if self._prepare(conn, create):
                    return conn
                conn.close()
                return None  # empty and only reading: nothing stored yet
            except _Unusable as bad:
                conn.close()
                if not bad.move:
                    logger.warning("plan cache %s: %s; ignoring it.", self.path, bad.reason)
                    return None
                if not self._move_aside(bad.reason, identity):
                    return None
            except sqlite3.DatabaseError as e:
                conn.close()
                if not _is_corruption(e):
                    raise
                if not self._move_aside(f"SQLite reports {e}", identity):
                    return None
            except BaseException:
                conn.close()
                raise
        return None

    def _prepare(self, conn: sqlite3.Connection, create: bool) -> bool:
        """Check the file is ours (raise _Unusable if not); make the schema when it has none yet
        (empty, or only optuna's tables) and `create`. True when the connection is ready for use."""
        if self._read_state(conn) == "empty":
            if not create:
                return False
            # Several processes may get here at once: the IMMEDIATE lock lets one make the
            # schema; the others wait, look again and find it made.
            with _write_transaction(conn):
                if self._state(conn) == "empty":
                    conn.execute(_SCHEMA)
                    conn.execute(f"PRAGMA application_id={APPLICATION_ID}")
                    conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        if create:
            _ensure_wal(conn)
            # With WAL, NORMAL never corrupts the file; a power cut may only lose the last
            # writes, which a cache can afford, and each commit skips an fsync.
            conn.execute("PRAGMA synchronous=NORMAL")
        return True

    def _read_state(self, conn: sqlite3.Connection) -> str:
        # One read transaction, so the marks and the tables come from the same snapshot even
        # while another process is making the schema.
        conn.execute("BEGIN")
        try:
            return self._state(conn)
        finally:
            if conn.in_transaction:
                conn.execute("ROLLBACK")

    @staticmethod
    def _state(conn: sqlite3.Connection) -> str:
        """"ok" (our schema), "empty" (no marks, and no tables or only optuna's) or raise _Unusable."""
        app_id = conn.execute("PRAGMA application_id").fetchone()[0]
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        if app_id == 0 and version == 0 and _only_optuna(tables):
            return "empty"
        if app_id != APPLICATION_ID:
            raise _Unusable(f"it is an SQLite file of something else (application_id {app_id}, "
                            f"tables {sorted(tables)})")
        if version > SCHEMA_VERSION:
            # A newer autofit wrote it; moving it aside would make two versions fight over it.
            raise _Unusable(f"it has schema version {version}, newer than this autofit's "
                            f"{SCHEMA_VERSION}", move=False)
        columns = [r[1] for r in conn.execute("PRAGMA table_info(plans)")]
        if version != SCHEMA_VERSION or columns != _COLUMNS:
            raise _Unusable(f"it has schema version {version} and plans columns {columns}; "
                            f"expected version {SCHEMA_VERSION} and {_COLUMNS}")
        return "ok"

    def _identity(self):
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_dev, st.st_ino)

    def _move_aside(self, reason: str, identity) -> bool:
        """Rename the bad file (and its -wal/-shm) to `<name>.corrupt-<timestamp>`. True when the
        path is free again (moved here, or already gone)."""
        if identity is None or self._identity() != identity:
            # Another process moved it and may have written a fresh cache since; leave that alone.
            logger.warning("plan cache %s: %s; another process already replaced it, so nothing was "
                           "moved.", self.path, reason)
            return True
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
        target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        try:
            os.replace(self.path, target)
        except FileNotFoundError:
            return True
        except OSError as e:
            logger.warning("plan cache %s: %s; could not move it aside (%s), so it is ignored and "
                           "nothing is cached.", self.path, reason, e)
            return False
        for suffix in ("-wal", "-shm"):
            side = self.path.with_name(self.path.name + suffix)
            try:
                os.replace(side, target.with_name(target.name + suffix))
            except OSError:
                pass  # absent, or already moved by another process
        logger.warning("plan cache %s: %s; not trusted, moved aside to %s; starting an empty cache.",
                       self.path, reason, target)
        return True

    def _run(self, create: bool, action, default):
        """`action(conn)` on a usable cache; `default` when there is none or it turns out corrupt.
        A read that a write-protected file (or folder) refuses is retried read-only: such a cache
        is still read, it only cannot learn."""
        if create:
            return self._run_once(create, action, default)
        modes = ("?mode=rw", "?mode=ro", "?mode=ro&immutable=1")
        for mode in modes[modes.index(getattr(self, "_read_mode", modes[0])):]:
            self._read_mode = mode
            try:
                return self._run_once(create, action, default)
            except sqlite3.OperationalError as e:
                if mode == modes[-1] or ("readonly" not in str(e) and "unable to open" not in str(e)):
                    raise
                logger.debug("plan cache %s: %s; reading it read-only", self.path, e)
        return default

    def _run_once(self, create: bool, action, default):
        conn = self._connect(create)
        if conn is None:
            return default
        identity = self._identity()
        try:
            return action(conn)
        except sqlite3.DatabaseError as e:
            if not _is_corruption(e):
                raise
            conn.close()
            self._move_aside(f"SQLite reports {e}", identity)
            if create:  # write into the fresh file instead
                conn = self._connect(create)
                if conn is not None:
                    return action(conn)
            return default
        finally:
            conn.close()


def _only_optuna(tables: list[str]) -> bool:
    """No table, or only optuna's (SQLite's own `sqlite_*` tables aside): a file we may add our
    schema to. Any optuna table counts, so a file optuna is still making is not taken as foreign."""
    names = {t for t in tables if not t.startswith("sqlite_")}
    return "plans" not in names and names <= OPTUNA_TABLES


def _ensure_wal(conn: sqlite3.Connection) -> None:
    """Switch the file to WAL (persistent, so once per file). Switching needs a lock that the
    busy timeout does not wait for, so retry for a while; without WAL the cache still works
    (rollback journal), only with less concurrency."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while conn.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
        if time.monotonic() > deadline:
            logger.debug("plan cache: could not switch to WAL; using the rollback journal.")
            return
        try:
            conn.execute("PRAGMA journal_mode=WAL")
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) and "busy" not in str(e):
                raise
            time.sleep(0.01)


@contextlib.contextmanager
def _write_transaction(conn: sqlite3.Connection):
    # IMMEDIATE takes the write lock up front (waiting up to the busy timeout), so two writers
    # never both read then fail to upgrade their lock.
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
