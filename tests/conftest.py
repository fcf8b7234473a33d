"""Shared fixtures. The plain builders live in tests/models.py (`from models import tiny_bert`);
this directory is put on sys.path so that import works however pytest is started."""

import gc
import os
import sys
import textwrap

import pytest
import torch

# One intra-op thread per test process: the suite runs one process per core (pytest-xdist, README's
# test command), and the tiny models here gain nothing from a second thread that would only
# compete with the other worker. Every exact comparison is within one process, at one thread count.
torch.set_num_threads(1)

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

# `models` imports transformers (seconds): import it inside the fixtures, so test files that need no
# model do not pay for it.


@pytest.fixture(name="tiny_bert")
def _tiny_bert():
    from models import tiny_bert
    return tiny_bert()


@pytest.fixture(name="tiny_gpt2")
def _tiny_gpt2():
    from models import tiny_gpt2
    return tiny_gpt2()


@pytest.fixture(name="bert_batch")
def _bert_batch():
    from models import bert_batch
    return bert_batch()


@pytest.fixture(name="gpt2_batch")
def _gpt2_batch():
    from models import gpt2_batch
    return gpt2_batch()


@pytest.fixture(autouse=True)
def _private_plan_cache(tmp_path, monkeypatch):
    """Every test gets its own plan cache: runs must not learn from other tests' runs."""
    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path / "autofit-cache"))


@pytest.fixture
def frozen_heap():
    """For tests that run many OOM recoveries: each one (and each run's end) may do a full
    `gc.collect()` (gpu.oom.collect: when the young generations leave device memory held, and
    always on a device that counts nothing), which walks every object alive, ~400k once torch, transformers and pytest are
    loaded (0.2-0.6 s a collection here). Everything alive before the test is moved to the
    permanent generation (`gc.freeze`), which collections skip, so they walk only what the test
    makes; what they free is the same. `gc.get_referrers`/`get_objects` do not see frozen objects:
    not for tests of autofit's diagnosis of who holds memory."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """Write a module into tmp_path and make it importable; forget it afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written = []

    def write(name, source):
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        written.append(name)
        return name

    yield write
    for name in written:
        sys.modules.pop(name, None)


# With README's command (pytest-xdist, --dist loadfile) the files are handed out whole, and xdist's
# own order is most tests first: the long spawned-rank scenarios (a few tests each, a minute or more)
# came last, where one of them kept a worker busy after the other had finished. Files with a slow
# test go first instead, so the short ones at the end let both workers finish together.
def pytest_configure(config):
    if getattr(config.option, "dist", None) == "loadfile":  # the controller: keep the order below
        config.option.loadscopereorder = False


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: the controller sets up each worker
def pytest_configure_node(node):
    node.workerinput["slow_files_first"] = node.config.option.dist == "loadfile"


@pytest.hookimpl(trylast=True)  # after -m and -k deselected what does not run
def pytest_collection_modifyitems(config, items):
    """In each worker: the files with a selected slow test first, then the others; within each group
    the files with the most tests first (xdist's own order); a file's tests keep their order."""
    if not getattr(config, "workerinput", {}).get("slow_files_first"):
        return
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)
    order = sorted(files.values(), key=lambda tests: (not any(t.get_closest_marker("slow") for t in tests),
                                                      -len(tests)))
    items[:] = [t for tests in order for t in tests]


@pytest.fixture(autouse=True)
def _sigint_handler_put_back():
    """A run installs autofit's SIGINT handler once and puts the one before it back when it closes
    (engine/interrupts.py): no test may leave it behind."""
    import signal
    before = signal.getsignal(signal.SIGINT)
    yield
    assert signal.getsignal(signal.SIGINT) is before, "a runner was left open: its SIGINT handler is still installed"
