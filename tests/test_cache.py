import logging
import multiprocessing
import os
import pathlib
import sqlite3
from datetime import datetime, timezone

import pytest

from autofit.cache.store import PlanCache, default_path
from autofit.cache.sqlite_file import APPLICATION_ID, OPTUNA_TABLES, SCHEMA_VERSION
from autofit.plans.plan import Plan

FIELDS = {"model": {"class": "m.M", "params": "ab" * 32, "n_params": 10}, "global_batch": 32}


def entry(micro=8, peak=123_456_789, calibration=1.07, throughput=412.5):
    return {"plan": Plan(micro_batch_size=micro, accumulation_steps=32 // micro, precision="bf16",
                         checkpointing=True).to_dict(),
            "peak_bytes": peak, "calibration": calibration, "throughput": throughput}


def corrupt_files(path: pathlib.Path) -> list[pathlib.Path]:
    return sorted(path.parent.glob(path.name + ".corrupt-*"))


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "autofit.cache.store" and r.levelno == logging.WARNING]


def test_round_trip(tmp_path):
    cache = PlanCache(tmp_path / "plans.sqlite")
    before = datetime.now(timezone.utc)
    cache.put("k1", FIELDS, entry())
    got = cache.get("k1")
    when = datetime.fromisoformat(got["when"])
    assert before <= when <= datetime.now(timezone.utc)
    assert got == {**entry(), "when": got["when"]}
    assert cache.get_plan("k1") == Plan(micro_batch_size=8, accumulation_steps=4, precision="bf16",
                                        checkpointing=True)
    assert cache.get("other") is None
    assert cache.get_plan("other") is None
    assert cache.entries() == [{"key": "k1", "fields": FIELDS, "entry": got}]
    # Upsert replaces; entries are newest first.
    cache.put("k2", FIELDS, entry(micro=4, calibration=None, throughput=None))
    cache.put("k1", {"x": 1}, entry(micro=2, peak=5))
    assert [e["key"] for e in cache.entries()] == ["k1", "k2"]
    assert cache.get("k1") == {**entry(micro=2, peak=5), "when": cache.get("k1")["when"]}
    assert cache.entries()[0]["fields"] == {"x": 1}
    assert cache.get("k2")["calibration"] is None


def test_file_is_wal_sqlite_with_our_marks(tmp_path):
    path = tmp_path / "deep" / "dir" / "plans.sqlite"
    PlanCache(path).put("k", FIELDS, entry())  # parent directories are created
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert conn.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
    conn.close()


def test_missing_file_is_not_created(tmp_path):
    path = tmp_path / "sub" / "plans.sqlite"
    cache = PlanCache(path)
    assert cache.get("k") is None
    assert cache.get_plan("k") is None
    assert cache.entries() == []
    assert cache.clear() == 0
    cache.close()
    assert not path.exists()
    assert not path.parent.exists()


def test_cache_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path / "mine"))
    assert default_path() == tmp_path / "mine" / "plans.sqlite"
    cache = PlanCache()
    assert cache.path == tmp_path / "mine" / "plans.sqlite"
    cache.put("k", FIELDS, entry())
    assert (tmp_path / "mine" / "plans.sqlite").is_file()
    monkeypatch.delenv("AUTOFIT_CACHE_DIR")
    import platformdirs
    assert default_path() == pathlib.Path(platformdirs.user_cache_dir("autofit")) / "plans.sqlite"


def test_corrupt_file_is_moved_aside(tmp_path, caplog):
    path = tmp_path / "plans.sqlite"
    garbage = os.urandom(8192)
    path.write_bytes(garbage)
    cache = PlanCache(path)
    with caplog.at_level(logging.WARNING, logger="autofit.cache.store"):
        assert cache.get("k") is None
    [moved] = corrupt_files(path)
    assert moved.read_bytes() == garbage
    assert not path.exists()
    [message] = warnings_of(caplog)
    assert str(path) in message and "file is not a database" in message and str(moved) in message
    cache.put("k", FIELDS, entry())
    assert cache.get("k") == {**entry(), "when": cache.get("k")["when"]}
    assert corrupt_files(path) == [moved]


def test_corrupt_file_found_by_put(tmp_path, caplog):
    path = tmp_path / "plans.sqlite"
    path.write_bytes(b"not a database at all")
    with caplog.at_level(logging.WARNING, logger="autofit.cache.store"):
        PlanCache(path).put("k", FIELDS, entry())
    [moved] = corrupt_files(path)
    assert moved.read_bytes() == b"not a database at all"
    assert len(warnings_of(caplog)) == 1
    assert [e["key"] for e in PlanCache(path).entries()] == ["k"]


@pytest.mark.parametrize("found_by", ["entries", "put"])
def test_corrupt_pages_are_moved_aside(tmp_path, caplog, found_by):
    path = tmp_path / "plans.sqlite"
    cache = PlanCache(path)
    for i in range(12):
        cache.put(f"k{i}", {"pad": "x" * 3000}, entry())
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()  # the last connection: everything is in the main file, no -wal left
    assert not path.with_name(path.name + "-wal").exists()
    data = bytearray(path.read_bytes())
    page = 4096
    assert len(data) > 4 * page
    data[2 * page:len(data)] = os.urandom(len(data) - 2 * page)  # keep the header and schema page
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="autofit.cache.store"):
        if found_by == "entries":
            assert cache.entries() == []
        else:
            cache.put("new", FIELDS, entry())  # lands in a fresh file
            assert [e["key"] for e in cache.entries()] == ["new"]
    [moved] = corrupt_files(path)
    assert moved.read_bytes() == bytes(data)
    [message] = warnings_of(caplog)
    assert "malformed" in message and str(moved) in message


def test_foreign_sqlite_is_moved_aside(tmp_path, caplog):
    path = tmp_path / "plans.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE plans (key TEXT PRIMARY KEY, value BLOB)")
    conn.execute("INSERT INTO plans VALUES ('k', x'80049500')")  # what a pickle would look like
    conn.execute("PRAGMA user_version=1")
    conn.commit()
    conn.close()
    original = path.read_bytes()
    cache = PlanCache(path)
    with caplog.at_level(logging.WARNING, logger="autofit.cache.store"):
        assert cache.get("k") is None
    [moved] = corrupt_files(path)
    assert moved.read_bytes() == original
    [message] = warnings_of(caplog)
    assert "SQLite file of something else (application_id 0, tables ['plans'])" in message
    assert str(path) in message and str(moved) in message
    cache.put("k", FIELDS, entry())
    assert cache.get("k")["peak_bytes"] == 123_456_789


def test_our_marks_with_another_schema_are_moved_aside(tmp_path, caplog):
    path = tmp_path / "plans.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE plans (key TEXT PRIMARY KEY, value TEXT)")
    conn.execute(f"PRAGMA application_id={APPLICATION_ID}")
    conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    conn.commit()
    conn.close()
    with caplog.at_level(logging.WARNING, logger="autofit.cache.store"):
        assert PlanCache(path).entries() == []
    assert len(corrupt_files(path)) == 1
    [message] = warnings_of(caplog)
    assert "plans columns ['key', 'value']" in message


def test_newer_schema_is_ignored_not_moved(tmp_path, caplog):
    path = tmp_path / "plans.sqlite"
    PlanCache(path).put("k", FIELDS, entry())
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    conn.commit()
    conn.close()
    cache = PlanCache(path)
    with caplog.at_level(logging.WARNING, logger="autofit.cache.store"):
        assert cache.get("k") is None
        cache.put("k2", FIELDS, entry())
    assert corrupt_files(path) == []
    assert warnings_of(caplog) == [
        f"plan cache {path}: it has schema version {SCHEMA_VERSION + 1}, newer than this autofit's "
        f"{SCHEMA_VERSION}; ignoring it."] * 2
    conn = sqlite3.connect(path)
    assert [r[0] for r in conn.execute("SELECT key FROM plans")] == ["k"]
    conn.close()


def test_empty_file_is_used(tmp_path):
    path = tmp_path / "plans.sqlite"
    path.touch()
    cache = PlanCache(path)
    assert cache.get("k") is None
    cache.put("k", FIELDS, entry())
    assert cache.get("k")["plan"]["micro_batch_size"] == 8
    assert corrupt_files(path) == []


def tables_of(path) -> list[str]:
    conn = sqlite3.connect(path)
    names = sorted(r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'"))
    conn.close()
    return names


def make_tables(path, names, application_id=0):
    conn = sqlite3.connect(path)
    for name in names:
        conn.execute(f"CREATE TABLE {name} (id INTEGER PRIMARY KEY)")
    conn.execute(f"PRAGMA application_id={application_id}")
    conn.commit()
    conn.close()


@pytest.mark.parametrize("names", [
    sorted(OPTUNA_TABLES),
    ["studies", "version_info"],  # optuna still making its tables (SQLAlchemy makes one at a time)
])
def test_a_file_with_only_optunas_tables_is_shared_not_foreign(tmp_path, caplog, names):
    path = tmp_path / "plans.sqlite"
    make_tables(path, names)
    cache = PlanCache(path)
    with caplog.at_level(logging.WARNING, logger="autofit.cache.store"):
        assert cache.get("k") is None  # reading adds nothing
        assert tables_of(path) == sorted(names)
        cache.put("k", FIELDS, entry())
    assert cache.get("k")["peak_bytes"] == 123_456_789
    assert tables_of(path) == sorted(names + ["plans"])
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    conn.close()
    assert (corrupt_files(path), warnings_of(caplog)) == ([], [])


@pytest.mark.parametrize("names, application_id", [
    (["studies", "version_info", "notes"], 0),        # optuna's tables beside someone else's
    (["studies", "version_info", "plans"], 0),        # a plans table without our marks
    (["studies", "version_info"], 0x12345678),        # another application's marks
])
def test_optunas_tables_do_not_make_a_foreign_file_ours(tmp_path, caplog, names, application_id):
    path = tmp_path / "plans.sqlite"
    make_tables(path, names, application_id)
    with caplog.at_level(logging.WARNING, logger="autofit.cache.store"):
        assert PlanCache(path).get("k") is None
    assert len(corrupt_files(path)) == 1
    [message] = warnings_of(caplog)
    assert f"SQLite file of something else (application_id {application_id}, tables {sorted(names)})" in message


def test_ensure_makes_the_file_once(tmp_path):
    path = tmp_path / "sub" / "plans.sqlite"
    cache = PlanCache(path)
    assert cache.ensure() is True
    assert tables_of(path) == ["plans"] and cache.entries() == []
    cache.put("k", FIELDS, entry())
    assert cache.ensure() is True
    assert [e["key"] for e in cache.entries()] == ["k"]


@pytest.mark.parametrize("optuna_first", [True, False])
def test_optuna_and_the_plan_cache_share_one_file_in_either_order(tmp_path, caplog, optuna_first):
    import optuna  # in the test extra
    path = tmp_path / "plans.sqlite"
    url = f"sqlite:///{path}"
    cache = PlanCache(path)

    def study_with_a_trial():
        study = optuna.create_study(study_name="s", storage=url, load_if_exists=True)
        study.enqueue_trial({"x": 1.0})
        study.optimize(lambda t: t.suggest_float("x", 0, 2), n_trials=1)

    with caplog.at_level(logging.WARNING, logger="autofit.cache.store"):
        if optuna_first:
            study_with_a_trial()
            cache.put("k", FIELDS, entry())
        else:
            cache.put("k", FIELDS, entry())
            study_with_a_trial()
        study_with_a_trial()  # optuna reopens the file after both wrote to it
        cache.put("k2", FIELDS, entry(micro=4))
    assert sorted(e["key"] for e in cache.entries()) == ["k", "k2"]
    assert [t.params for t in optuna.load_study(study_name="s", storage=url).trials] == [{"x": 1.0}] * 2
    assert {"plans", "studies", "trials"} <= set(tables_of(path))
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
    conn.close()
    assert (corrupt_files(path), warnings_of(caplog)) == ([], [])


@pytest.mark.parametrize("column, text, problem", [
    ("entry", "{not json", "is not valid JSON"),
    ("fields", "[1,", "is not valid JSON"),
    ("entry", '{"plan": {"micro_batch_size": 8}, "calibration": 1.0, "throughput": 2.0, "when": "x"}',
     "is invalid (the entry lacks ['peak_bytes'])"),
    ("entry", '{"plan": {"micro_batch_size": 0}, "peak_bytes": 1, "calibration": null, '
              '"throughput": null, "when": "x"}',
     "is invalid (entry['plan'] is not a valid Plan (micro_batch_size must be a positive int but got 0.))"),
    ("entry", '{"plan": {"micro_batch_size": 8}, "peak_bytes": 1, "calibration": null, "throughput": null}',
     "is invalid (the entry lacks 'when')"),
    ("entry", '{"plan": {"micro_batch_size": 8, "exec": "rm"}, "peak_bytes": 1, "calibration": null, '
              '"throughput": null, "when": "x"}', "unknown Plan fields ['exec']"),
    ("entry", '{"plan": {"micro_batch_size": 8}, "peak_bytes": -5, "calibration": null, '
              '"throughput": null, "when": "x"}',
     "entry['peak_bytes'] must be a non-negative int but got -5"),
    ("fields", '"just a string"', "its fields must be a JSON object but are str"),
])
def test_bad_row_is_ignored_and_reported(tmp_path, caplog, column, text, problem):
    path = tmp_path / "plans.sqlite"
    cache = PlanCache(path)
    cache.put("bad", FIELDS, entry())
    cache.put("good", FIELDS, entry())
    conn = sqlite3.connect(path)
    conn.execute(f"UPDATE plans SET {column} = ? WHERE key = 'bad'", (text,))
    conn.commit()
    conn.close()
    with caplog.at_level(logging.WARNING, logger="autofit.cache.store"):
        assert cache.get("bad") is None
        assert cache.get_plan("bad") is None
        assert [e["key"] for e in cache.entries()] == ["good"]
    messages = warnings_of(caplog)
    assert len(messages) == 3
    assert all(m.startswith(f"plan cache {path}: row bad ") and problem in m for m in messages), messages
    assert cache.get("good") is not None
    assert corrupt_files(path) == []  # a bad row is not a bad file
    cache.put("bad", FIELDS, entry())  # a later put repairs it
    assert cache.get("bad") == {**entry(), "when": cache.get("bad")["when"]}


def test_clear(tmp_path):
    cache = PlanCache(tmp_path / "plans.sqlite")
    for i in range(3):
        cache.put(f"k{i}", FIELDS, entry())
    cache.put("k0", FIELDS, entry())
    assert cache.clear() == 3
    assert cache.entries() == []
    assert cache.clear() == 0


@pytest.mark.parametrize("call, error, words", [
    (lambda c: c.put("", FIELDS, entry()), ValueError, "key must be a non-empty string (from job_key) but got ''"),
    (lambda c: c.get(None), ValueError, "key must be a non-empty string (from job_key) but got None"),
    (lambda c: c.put("k", [1], entry()), TypeError, "fields must be a dict (from job_key) but got list"),
    (lambda c: c.put("k", FIELDS, {**entry(), "plan": Plan(4)}), ValueError,
     "entry['plan'] must be a dict (Plan.to_dict()) but got Plan"),
    (lambda c: c.put("k", FIELDS, {"plan": Plan(4).to_dict()}), ValueError,
     "the entry lacks ['peak_bytes', 'calibration', 'throughput']"),
    (lambda c: c.put("k", FIELDS, {**entry(), "calibration": float("nan")}), ValueError,
     "entry['calibration'] must be a finite number or None but got nan"),
    (lambda c: c.put("k", FIELDS, {**entry(), "peak_bytes": 1.5}), ValueError,
     "entry['peak_bytes'] must be a non-negative int but got 1.5"),
    (lambda c: c.put("k", {"f": object()}, entry()), ValueError,
     "cache fields and entry must be plain JSON data: Object of type object is not JSON serializable"),
])
def test_bad_arguments(tmp_path, call, error, words):
    cache = PlanCache(tmp_path / "plans.sqlite")
    with pytest.raises(error) as info:
        call(cache)
    assert words in str(info.value)
    assert not cache.path.exists()


def test_bad_paths(tmp_path):
    with pytest.raises(TypeError, match="path must be a str, an os.PathLike or None but got int 3"):
        PlanCache(3)
    with pytest.raises(ValueError, match="is a directory; pass a file path such as"):
        PlanCache(tmp_path)


def _writer(jobs, worker, barrier):
    for path, count in jobs:
        cache = PlanCache(path)
        barrier.wait(30)  # start together, on a file that does not exist yet
        for i in range(count):
            cache.put(f"w{worker}-{i}", {"worker": worker, "i": i}, entry(peak=worker * 1000 + i))
            cache.put("shared", {"worker": worker, "i": i}, entry(peak=worker * 1000 + i))


def check_written(path, count):
    rows = {e["key"]: e for e in PlanCache(path).entries()}
    assert len(rows) == 2 * count + 1
    for w in (1, 2):
        for i in range(count):
            row = rows[f"w{w}-{i}"]
            assert row["fields"] == {"worker": w, "i": i}
            assert row["entry"] == {**entry(peak=w * 1000 + i), "when": row["entry"]["when"]}
    shared = rows["shared"]
    assert shared["fields"]["i"] == count - 1
    assert shared["entry"]["peak_bytes"] == shared["fields"]["worker"] * 1000 + count - 1
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.close()
    assert corrupt_files(path) == []


@pytest.mark.slow
def test_two_processes_write_at_once(tmp_path):
    # 50 puts each to one cache, then 10 fresh caches with 2 puts each: both processes race to
    # create the file and its schema, which is where a naive open fails.
    jobs = [(str(tmp_path / "plans.sqlite"), 50)] + [(str(tmp_path / f"c{n}.sqlite"), 2) for n in range(10)]
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_writer, args=(jobs, w, barrier)) for w in (1, 2)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
    finally:
        for p in procs:  # a worker that died leaves the other at the barrier; do not hang
            if p.is_alive():
                p.terminate()
                p.join()
    assert [p.exitcode for p in procs] == [0, 0]
    for path, count in jobs:
        check_written(pathlib.Path(path), count)


# -- the cache never raises into a run, and rows that contradict the job are ignored ----------------

def _job(precision="auto", model=None, **options):
    import torch

    import autofit
    torch.manual_seed(0)
    model = model or torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.ReLU(),
                                         torch.nn.Linear(16, 3))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(2)]
    return autofit.run(model, data, loss_fn=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
                       budget="64MiB", precision=precision, progress=False, capacity_check=False, **options)


def _memo_warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "autofit" and r.levelno == logging.WARNING]


def _rewrite_entry(path, change):
    import json
    with sqlite3.connect(path) as conn:
        [(key, text)] = conn.execute("SELECT key, entry FROM plans").fetchall()
        entry = json.loads(text)
        change(entry)
        conn.execute("UPDATE plans SET entry = ? WHERE key = ?", (json.dumps(entry), key))
    conn.close()


def test_a_cache_path_that_is_a_directory_does_not_stop_the_run(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path))
    (tmp_path / "plans.sqlite").mkdir()
    with caplog.at_level(logging.WARNING):
        result = _job()
    assert [a.outcome for a in result.attempts] == ["ok", "ok"]
    assert _memo_warnings(caplog) == [
        f"plan cache not used: the plan cache path {str(tmp_path / 'plans.sqlite')!r} is a directory; "
        f"pass a file path such as {str(tmp_path / 'plans.sqlite' / 'plans.sqlite')!r}."]


@pytest.mark.parametrize("sizes", [
    {"fits": [[["fp32", False, False], [[None, "eight"]]]], "fails": []},
    {"fits": [[["fp32", False, False], [[None, -3]]]], "fails": []},
    {"fits": "not a list", "fails": 7},
], ids=["a text size", "a negative size", "not tables"])
def test_a_row_with_bad_sizes_uses_its_plan_only(tmp_path, caplog, sizes):
    _job()
    path = default_path()
    _rewrite_entry(path, lambda e: e.update(sizes=sizes))
    with caplog.at_level(logging.WARNING):
        second = _job()
    assert second.attempts[0].reason.startswith("cached: worked for this job")
    assert [a.outcome for a in second.attempts] == ["ok", "ok"]
    assert any("the sizes of entry" in m and "unreadable" in m for m in _memo_warnings(caplog))


@pytest.mark.parametrize("plan,precision,why", [
    ({"precision": "bf16"}, "fp32", "its plan is bf16 but this job asks for precision='fp32'"),
    ({"checkpointing": True}, "fp32", "activation checkpointing does not apply to _NoBlocks"),
], ids=["bf16 for an fp32 job", "checkpointing for a model without blocks"])
def test_a_row_that_contradicts_the_job_is_ignored(tmp_path, caplog, plan, precision, why):
    import torch

    class _NoBlocks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 3)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))
    _job(precision, model=_NoBlocks())
    _rewrite_entry(default_path(), lambda e: e["plan"].update(plan))
    with caplog.at_level(logging.WARNING):
        second = _job(precision, model=_NoBlocks())
    assert second.attempts[0].reason == "start: the whole global batch at once"
    assert second.plan == Plan(8)
    assert any("ignored" in m and why in m for m in _memo_warnings(caplog)), _memo_warnings(caplog)


def test_a_write_protected_cache_is_still_read(tmp_path, monkeypatch):
    """SQLite refuses to open a write-protected file (or one in a write-protected folder, WAL) for
    writing; the read is retried read-only. (Tests run as root, so the refusal is simulated.)"""
    cache = PlanCache(tmp_path / "plans.sqlite")
    cache.put("k" * 64, FIELDS, entry())
    real = sqlite3.connect
    opened = []

    def refusing(database, *args, **kwargs):
        opened.append(database.split("?")[1])
        if "mode=rw" in database:
            raise sqlite3.OperationalError("attempt to write a readonly database")
        return real(database, *args, **kwargs)
    monkeypatch.setattr(sqlite3, "connect", refusing)
    assert PlanCache(tmp_path / "plans.sqlite").get("k" * 64)["plan"] == entry()["plan"]
    assert opened == ["mode=rw", "mode=ro"]
