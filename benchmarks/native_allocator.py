"""Counting through the CPU allocator instead of per-op dispatch: a prototype and its figures.
(Over 300 lines: the C++ source of the prototype, its checks and its three tables are one
experiment whose figures must come from one build and one run.)

    python benchmarks/native_allocator.py [--repeats 5] [--steps 20] [--warmup 5] [--cold]

The simulated GPU counts memory with a TorchDispatchMode: every op costs a C++ -> Python call, and
a do-nothing mode alone already costs ~1.26x a plain step on overhead.py's model. This script builds
(torch.utils.cpp_extension.load_inline, into a temporary directory, once) a c10::Allocator that
wraps the default CPU allocator and counts only on the threads that enable it, so Python is entered
per allocation and per free (or never), not per op, and measures:

Table 1: compile time, cold (a fresh build directory; only when this run built it, or with --cold)
and cached (a new process loading the built extension).
Table 2: checks of the mechanism: the OOM it raises, fault injection, swapping the allocator back
and forth (SetCPUAllocator's priority), frees of memory allocated before the swap, memory freed
after the counting stopped, autograd's backward and intra-op threads, DataLoader workers, and the
allocations a dispatch mode cannot see (temporaries made and freed inside one op's kernel) on
overhead.py's step and on a GPT-2 LM step; table 2b: the peaks each way.
Table 3: the cost per op (us of process time, best of 7 rounds of 3000 ops), as overhead.py's
table 4, and the cost per step on overhead.py's model and plain loop (paired repeats, as there) for
(a) the counter kept in C++, (b0) a Python call per allocation and per free doing nothing, (b) that
call feeding autofit's model of CUDA's caching allocator (autofit.gpu.allocator), against the plain
loop, the do-nothing dispatch mode and simulate_gpu().

Without a C++ compiler or ninja it says so and exits 0. torch.set_num_threads(1) as overhead.py.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from common import gpt2, lm_batches, print_environment, setup, table
from overhead import (BATCH, SEQ, VOCAB, StepClock, _NoOpMode, adamw, build, cls_batches, measure,
                      paired, plain_step, ratio_row, run_plain, run_plain_noop_mode)

import torch  # noqa: E402
import autofit  # noqa: E402
from autofit.gpu.allocator import CachingAllocator  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

NAME = "autofit_native_alloc"

# Headers kept to what the allocator needs (Python.h, c10's Allocator and Exception): no pybind11,
# no torch/extension.h, which is most of a cold build's time.
SOURCE = r"""
#include <Python.h>
#include <pthread.h>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

namespace {

// Every block this allocator hands out starts 64 bytes after the default allocator's block (its
// alignment kept): the header says whether and where it was counted, so a free needs no lookup
// and the data pointer stays the context (is_simple_data_ptr holds; copy-on-write works).
constexpr size_t kHeader = 64;
struct Header { uint64_t session; int64_t counted; };

thread_local bool t_on = false;          // this thread's allocations count
thread_local bool t_in_callback = false; // no counting inside our own Python calls
std::atomic<bool> g_all_threads{false};  // count every thread's allocations
std::atomic<uint64_t> g_session{0};      // 0: not counting; a free counts only in its own session
uint64_t g_next_session = 1;
std::atomic<int64_t> g_live{0}, g_peak{0}, g_count{0}, g_total{0};
int64_t g_budget = -1;                   // bytes; -1 no limit
int64_t g_fail_at = -1;                  // allocation index that fails once; -1 none
PyObject* g_on_alloc = nullptr;          // (ptr, nbytes) -> None | str (an OOM message)
PyObject* g_on_free = nullptr;           // (ptr) -> None
c10::Allocator* g_inner = nullptr;       // the allocator we wrap (the default CPU one)
c10::DeleterFnPtr g_inner_delete = nullptr;
std::atomic<bool> g_off_in_children{false};  // a forked child (DataLoader worker) stops counting

int64_t rounded(size_t n) { return static_cast<int64_t>((n + 511) / 512 * 512); }

void counted_delete(void* data) {
  char* base = static_cast<char*>(data) - kHeader;
  auto* h = reinterpret_cast<Header*>(base);
  if (h->session != 0 && h->session == g_session.load(std::memory_order_relaxed)) {
    g_live.fetch_sub(h->counted, std::memory_order_relaxed);
    if (g_on_free != nullptr && Py_IsInitialized()) {
      PyGILState_STATE gil = PyGILState_Ensure();
      PyObject* ptr = PyLong_FromVoidPtr(data);
      PyObject* r = PyObject_CallOneArg(g_on_free, ptr);
      Py_DECREF(ptr);
      if (r == nullptr) PyErr_WriteUnraisable(g_on_free);
      Py_XDECREF(r);
      PyGILState_Release(gil);
    }
  }
  g_inner_delete(base);
}

void out_of_memory(size_t n, const char* why) {
  TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory. Tried to allocate ", n,
                   " bytes (native counter: ", g_live.load(), " bytes live, budget ", g_budget,
                   ")", why);
}

struct CountingAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* base = g_inner->raw_allocate(n + kHeader);
    auto* h = static_cast<Header*>(base);
    h->session = 0;
    h->counted = 0;
    char* data = static_cast<char*>(base) + kHeader;
    uint64_t session = g_session.load(std::memory_order_relaxed);
    if (session != 0 && n != 0 && !t_in_callback && (t_on || g_all_threads.load())) {
      int64_t c = rounded(n);
      int64_t k = g_count.fetch_add(1);
      if (k == g_fail_at) {
        g_fail_at = -1;
        g_inner_delete(base);
        out_of_memory(n, " (injected fault)");
      }
      if (g_budget >= 0 && g_live.load() + c > g_budget) {
        g_inner_delete(base);
        out_of_memory(n, "");
      }
      if (g_on_alloc != nullptr) {
        std::string error;
        bool oom = false;
        {
          PyGILState_STATE gil = PyGILState_Ensure();
          t_in_callback = true;
          PyObject* args[2] = {PyLong_FromVoidPtr(data), PyLong_FromSize_t(n)};
          PyObject* r = PyObject_Vectorcall(g_on_alloc, args, 2, nullptr);
          t_in_callback = false;
          Py_DECREF(args[0]);
          Py_DECREF(args[1]);
          if (r == nullptr) {
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyObject* s = value ? PyObject_Str(value) : nullptr;
            error = s ? PyUnicode_AsUTF8(s) : "the allocation callback failed";
            Py_XDECREF(s); Py_XDECREF(type); Py_XDECREF(value); Py_XDECREF(tb);
          } else if (PyUnicode_Check(r)) {
            error = PyUnicode_AsUTF8(r);
            oom = true;
          }
          Py_XDECREF(r);
          PyGILState_Release(gil);
        }
        if (!error.empty()) {
          g_inner_delete(base);
          if (oom) TORCH_CHECK_WITH(OutOfMemoryError, false, error);
          TORCH_CHECK(false, "allocation callback raised: ", error);
        }
      }
      h->session = session;
      h->counted = c;
      int64_t live = g_live.fetch_add(c) + c;
      g_total.fetch_add(c, std::memory_order_relaxed);
      int64_t peak = g_peak.load();
      while (live > peak && !g_peak.compare_exchange_weak(peak, live)) {}
    }
    return {data, data, &counted_delete, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &counted_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CountingAllocator g_counting;  // static lifetime: storages keep a pointer to their allocator

void in_child() {  // pthread_atfork: runs in the child, on the thread that forked
  if (g_off_in_children.load()) {
    g_session = 0;
    t_on = false;
  }
}

PyObject* install(PyObject*, PyObject* arg) {
  long priority = PyLong_AsLong(arg);
  if (priority == -1 && PyErr_Occurred()) return nullptr;
  if (g_inner == nullptr) {
    pthread_atfork(nullptr, nullptr, &in_child);
    g_inner = c10::GetCPUAllocator();
    g_inner_delete = g_inner->raw_deleter();
    if (g_inner_delete == nullptr) {
      g_inner = nullptr;
      PyErr_SetString(PyExc_RuntimeError, "the current CPU allocator has no raw deleter to wrap");
      return nullptr;
    }
  }
  c10::SetCPUAllocator(&g_counting, static_cast<uint8_t>(priority));
  return PyBool_FromLong(c10::GetCPUAllocator() == &g_counting);
}

PyObject* uninstall(PyObject*, PyObject* arg) {
  long priority = PyLong_AsLong(arg);
  if (priority == -1 && PyErr_Occurred()) return nullptr;
  if (g_inner != nullptr) c10::SetCPUAllocator(g_inner, static_cast<uint8_t>(priority));
  return PyBool_FromLong(c10::GetCPUAllocator() != &g_counting);
}

PyObject* current(PyObject*, PyObject*) {
  c10::Allocator* a = c10::GetCPUAllocator();
  const char* s = a == &g_counting ? "counting"
                  : (a == c10::GetDefaultCPUAllocator() ? "default" : "other");
  return PyUnicode_FromString(s);
}

PyObject* start(PyObject*, PyObject* args) {
  long long budget;
  int all_threads;
  if (!PyArg_ParseTuple(args, "Lp", &budget, &all_threads)) return nullptr;
  g_budget = budget;
  g_fail_at = -1;
  g_live = 0; g_peak = 0; g_count = 0; g_total = 0;
  g_all_threads = all_threads != 0;
  g_session = g_next_session++;
  t_on = true;
  Py_RETURN_NONE;
}

PyObject* stop(PyObject*, PyObject*) {
  g_session = 0;
  g_all_threads = false;
  t_on = false;
  Py_RETURN_NONE;
}

PyObject* enable(PyObject*, PyObject* arg) {
  bool was = t_on;
  t_on = PyObject_IsTrue(arg) == 1;
  return PyBool_FromLong(was);
}

PyObject* callbacks(PyObject*, PyObject* args) {
  PyObject *on_alloc, *on_free;
  if (!PyArg_ParseTuple(args, "OO", &on_alloc, &on_free)) return nullptr;
  Py_XDECREF(g_on_alloc); Py_XDECREF(g_on_free);
  g_on_alloc = on_alloc == Py_None ? nullptr : (Py_INCREF(on_alloc), on_alloc);
  g_on_free = on_free == Py_None ? nullptr : (Py_INCREF(on_free), on_free);
  Py_RETURN_NONE;
}

PyObject* off_in_children(PyObject*, PyObject* arg) {
  g_off_in_children = PyObject_IsTrue(arg) == 1;
  Py_RETURN_NONE;
}

PyObject* fail_at(PyObject*, PyObject* arg) {
  g_fail_at = PyLong_AsLongLong(arg);
  if (g_fail_at == -1 && PyErr_Occurred()) return nullptr;
  Py_RETURN_NONE;
}

PyObject* stats(PyObject*, PyObject*) {
  return Py_BuildValue("{s:L,s:L,s:L,s:L,s:O}", "live", (long long)g_live.load(),
                       "peak", (long long)g_peak.load(), "allocations", (long long)g_count.load(),
                       "total", (long long)g_total.load(),
                       "this_thread", t_on ? Py_True : Py_False);
}

PyMethodDef methods[] = {
    {"install", install, METH_O, "SetCPUAllocator(counting, priority) -> whether it took"},
    {"uninstall", uninstall, METH_O, "SetCPUAllocator(wrapped, priority) -> whether ours is gone"},
    {"current", current, METH_NOARGS, "'counting', 'default' or 'other'"},
    {"start", start, METH_VARARGS, "start(budget or -1, all_threads): new session, thread on"},
    {"stop", stop, METH_NOARGS, "end the session: nothing counts, later frees are not subtracted"},
    {"enable", enable, METH_O, "count this thread's allocations or not; returns the old flag"},
    {"callbacks", callbacks, METH_VARARGS, "(on_alloc(ptr, n) -> None | str, on_free(ptr))"},
    {"fail_at", fail_at, METH_O, "make the allocation with this index raise OOM once"},
    {"off_in_children", off_in_children, METH_O, "forked children stop counting (or not)"},
    {"stats", stats, METH_NOARGS, "live, peak, allocations, total bytes, this thread's flag"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "autofit_native_alloc", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_autofit_native_alloc(void) { return PyModule_Create(&module); }
"""


# -- building -------------------------------------------------------------------------------------

def missing_tools() -> list[str]:
    """What load_inline needs and this machine lacks: the C++ compiler it calls ($CXX, else c++),
    ninja, Python's headers."""
    import sysconfig
    cxx = os.environ.get("CXX", "c++")
    missing = [] if shutil.which(cxx) else [f"C++ compiler ({cxx!r} not on PATH; set CXX)"]
    try:
        from torch.utils.cpp_extension import verify_ninja_availability
        verify_ninja_availability()
    except Exception:
        missing.append("ninja")
    if not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        missing.append("Python.h (the python3-dev headers)")
    return missing


def build_dir() -> str:
    """One build per source and torch version, reused by later runs (the cached compile)."""
    key = hashlib.sha256((SOURCE + torch.__version__ + sys.version).encode()).hexdigest()[:12]
    return os.path.join(tempfile.gettempdir(), f"autofit-native-alloc-{key}")


def load(directory: str):
    from torch.utils.cpp_extension import load_inline
    os.makedirs(directory, exist_ok=True)
    return load_inline(NAME, [SOURCE], build_directory=directory, no_implicit_headers=True,
                       extra_cflags=["-O2"], verbose=False)


def cached_load_seconds(directory: str) -> float:
    """Seconds a fresh process spends in load_inline when the build is already there."""
    code = ("import sys, time; sys.path.insert(0, %r); import native_allocator as n; "
            "t = time.perf_counter(); n.load(%r); print(time.perf_counter() - t)"
            % (os.path.dirname(os.path.abspath(__file__)), directory))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         check=True)
    return float(out.stdout.strip().splitlines()[-1])


# -- counting sessions ----------------------------------------------------------------------------

class AllocatorFeed:
    """(b): each counted allocation and free fed to autofit's model of CUDA's caching allocator,
    as the simulated GPU feeds it per storage; an allocation the model cannot place is the OOM."""

    def __init__(self, budget=None):
        self.model = CachingAllocator(budget)
        self.blocks = {}

    def alloc(self, ptr, nbytes):
        try:
            self.blocks[ptr] = self.model.malloc(nbytes)
        except Exception:  # AllocationFailed: the message is the OOM's
            return f"CUDA out of memory. Tried to allocate {nbytes} bytes (allocator model: " \
                   f"{self.model.reserved} reserved)"
        return None

    def free(self, ptr):
        block = self.blocks.pop(ptr, None)
        if block is not None:
            self.model.free(block)


def _nothing(*_):
    return None


VARIANTS = {  # name -> callbacks factory (None: the counter alone, in C++)
    "a": None,
    "b0": lambda: (_nothing, _nothing),
    "b": lambda: (lambda f: (f.alloc, f.free))(AllocatorFeed()),
}


@contextlib.contextmanager
def counting(native, budget: int = -1, callbacks=None, all_threads: bool = False,
             priority: int = 0):
    """The counting allocator installed and a session open on this thread; both undone after."""
    if not native.install(priority):
        raise RuntimeError(f"SetCPUAllocator(priority={priority}) did not take: another allocator "
                           f"holds a higher priority ({native.current()})")
    native.callbacks(*(callbacks or (None, None)))
    native.start(budget, all_threads)
    try:
        yield native
    finally:
        native.stop()
        native.callbacks(None, None)
        native.uninstall(priority)


def run_native(native, batches, variant: str | None):
    """overhead.py's plain loop with the counting allocator (None: installed, not counting)."""
    model = build()
    model.train()
    clock = StepClock()
    opt = clock.attach(adamw(model.parameters()))
    factory = VARIANTS.get(variant)
    with counting(native, callbacks=factory() if factory else None):
        if variant is None:
            native.enable(False)
        for b in batches:
            plain_step(model, opt, b)
    return clock, model


# -- checks of the mechanism ----------------------------------------------------------------------

def check_oom(native) -> list[list]:
    from autofit.gpu.oom import is_oom
    rows = []
    with counting(native, budget=1 << 20):
        try:
            torch.empty(2 << 20, dtype=torch.uint8)
            got = "nothing raised"
        except Exception as e:  # noqa: BLE001 (the type is what is checked)
            got = (f"{type(e).__module__}.{type(e).__name__}, is_oom {is_oom(e)}: "
                   f"{str(e).splitlines()[0][:110]}")
        live = native.stats()["live"]
    rows.append(["budget 1 MiB, torch.empty(2 MiB)", f"{got}; live after {live}"])
    with counting(native):
        torch.ones(10) + 0
        per_line = native.stats()["allocations"]  # the wrapped scalar counts too
        native.fail_at(per_line * 3 + 1)  # the second allocation of the loop's third line
        raised = []
        for i in range(4):
            try:
                torch.ones(10) + i
            except torch.OutOfMemoryError as e:
                raised.append((i, "injected" in str(e)))
    rows.append([f"fail_at({per_line * 3 + 1}) after a line of {per_line} allocations, 4 lines",
                 f"(line, injected) of each OOM: {raised} (expected: [(2, True)], once)"])
    refuse = (lambda p, n: "CUDA out of memory. (from the callback)", _nothing)
    with counting(native, callbacks=refuse):
        try:
            torch.empty(100)
            got = "nothing raised"
        except torch.OutOfMemoryError as e:
            got = f"torch.OutOfMemoryError: {e}".splitlines()[0][:70]
    rows.append(["Python callback returns a message", got])

    def broken(p, n):
        raise ValueError("bug in the callback")
    with counting(native, callbacks=(broken, _nothing)):
        try:
            torch.empty(100)
            got = "nothing raised"
        except Exception as e:  # noqa: BLE001
            got = f"{type(e).__name__}: {str(e).splitlines()[0][:60]}"
    rows.append(["Python callback raises ValueError", got])
    return rows


PRIORITY_SCRIPT = """
import sys, torch; sys.path.insert(0, %r); import native_allocator as n
m = n.load(%r)
steps = []
for p_in, p_out in [(0, 0), (0, 0), (0, 0), (1, 0), (1, 1), (0, 1), (0, 0)]:
    ok_in = m.install(p_in); x = torch.ones(8); ok_out = m.uninstall(p_out); now = m.current()
    steps.append(f"in p{p_in} {'ok' if ok_in else 'REFUSED'} / out p{p_out} -> {now}")
print('; '.join(steps))
"""


def check_swaps(native, directory) -> list[list]:
    """SetCPUAllocator back and forth, in a fresh process: a priority once raised stays raised."""
    code = PRIORITY_SCRIPT % (os.path.dirname(os.path.abspath(__file__)), directory)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    return [["install/uninstall (priority in / out)", out.stdout.strip() or out.stderr[-200:]]]


def check_lifetimes(native) -> list[list]:
    before = torch.randn(1 << 18)  # 1 MiB, from the default allocator before the swap
    with counting(native):
        kept = torch.randn(1 << 18)
        del before
        live = native.stats()["live"]
    after_stop = native.current()
    del kept  # freed with our deleter after the default allocator is back: no session, no count
    with counting(native):
        fresh = native.stats()["live"]
    return [["free of memory allocated before the swap", f"counter {live} B (1 MiB counted: the "
             f"tensor made inside; the earlier one's deleter is the default's, never seen)"],
            ["free after stop + uninstall (allocator now " + after_stop + ")",
             f"no error; the next session starts at {fresh} B"]]


def check_threads(native, batches) -> list[list]:
    rows = []
    model = build()
    opt = adamw(model.parameters())
    plain_step(model, opt, batches[0])  # optimizer state made outside the count
    param = next(model.parameters())
    where = set()
    handle = param.register_hook(lambda g: where.add(threading.get_ident()))
    for threads in (1, 2):
        torch.set_num_threads(threads)
        counts = {}
        for all_threads in (False, True):
            with counting(native, all_threads=all_threads):
                plain_step(model, opt, batches[1])
                s = native.stats()
                counts[all_threads] = (s["allocations"], s["total"])
        rows.append([f"one step, {threads} intra-op thread(s): this thread only / all threads",
                     f"{counts[False][0]} / {counts[True][0]} allocations, "
                     f"{counts[False][1] / 2**20:.2f} / {counts[True][1] / 2**20:.2f} MiB"])
    torch.set_num_threads(1)
    handle.remove()
    main = threading.get_ident()
    rows.append(["autograd backward: threads that ran a gradient hook",
                 f"{len(where)}, {'the caller' if where == {main} else 'NOT only the caller'}"])
    seen = {}

    def other():
        seen["x"] = torch.randn(1000)
        seen["stats"] = native.stats()
    for all_threads in (False, True):
        with counting(native, all_threads=all_threads):
            t = threading.Thread(target=other)
            t.start(); t.join()
            seen[all_threads] = native.stats()["allocations"]
            del seen["x"]
    rows.append(["a Python thread's allocation: this thread only / all threads",
                 f"{seen[False]} / {seen[True]} counted (the other thread's flag: "
                 f"{seen['stats']['this_thread']})"])
    return rows


def check_storages(native) -> list[list]:
    """Memory that reaches a tensor other than as an op's new output: counted by each mechanism."""
    import numpy as np
    cases = {
        "torch.UntypedStorage(4096) from Python": lambda old: torch.UntypedStorage(4096),
        "torch.from_numpy (numpy's memory)": lambda old: torch.from_numpy(np.ones(1024)),
        "resize_ of a storage made before, to 64 KiB": lambda old: old.resize_(1 << 16),
        "resize_ of a storage made inside, to 64 KiB": lambda old: torch.empty(0).untyped_storage()
        .resize_(1 << 16),
        "torch.tensor([1.0] * 1024) from a Python list": lambda old: torch.tensor([1.0] * 1024),
    }
    rows = []
    for name, make in cases.items():
        old = torch.empty(0).untyped_storage()  # made before: keeps the default allocator
        with counting(native):
            kept = make(old)  # noqa: F841 (alive while the counter is read)
            by_allocator = native.stats()["total"]
            del kept
        old = torch.empty(0).untyped_storage()
        with autofit.simulate_gpu() as gpu:
            kept = make(old)
            by_mode = gpu.memory_allocated()
            del kept
        rows.append([name, f"allocator {by_allocator} B, simulate_gpu() {by_mode} B"])
    return rows


class _WorkerData(torch.utils.data.Dataset):
    """Items made in a DataLoader worker, each saying what the worker's counter saw."""

    native = None

    def __len__(self):
        return 8

    def __getitem__(self, i):
        x = torch.randn(256)
        s = self.native.stats()
        return x, torch.tensor([int(s["this_thread"]), s["allocations"], os.getpid()])


def check_workers(native) -> list[list]:
    _WorkerData.native = native
    loader = torch.utils.data.DataLoader(_WorkerData(), batch_size=4, num_workers=2)
    rows = []
    for off in (False, True):
        native.off_in_children(off)
        with counting(native):
            before = native.stats()["allocations"]
            infos = [info for _, info in loader]
            after = native.stats()["allocations"]
        flags = sorted({int(r[0]) for i in infos for r in i})
        counts = [int(r[1]) for i in infos for r in i]
        with counting(native, budget=512):
            try:
                list(loader)
                oom = "no error"
            except Exception as e:  # noqa: BLE001
                oom = f"{type(e).__name__}: {str(e).splitlines()[0][:60]}"
        gc.collect()  # the failed iterator, held by the traceback's cycle, is shut down here and
        # not in the next round's forked workers
        how = "a pthread_atfork child handler stops counting" if off else "as forked"
        rows += [[f"DataLoader, 2 forked workers, {how}",
                  f"workers' flag {flags}; a worker's copy of the counter read {min(counts)}.."
                  f"{max(counts)} allocations over 8 items; the parent counted {after - before} "
                  f"while iterating"],
                 ["    the same with a 512-byte budget", oom]]
    native.off_in_children(False)
    return rows


class _Recorder(TorchDispatchMode):
    """Which counted allocations each op returns as its outputs' storages (what a dispatch mode
    sees) and which it does not: temporaries made inside the op's kernel."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __init__(self, log):
        super().__init__()
        self.log = log  # AllocationLog
        self.in_op = False
        self.attributed = self.attributed_bytes = 0  # allocations made while an op ran
        self.hidden: dict[str, list[int]] = {}  # op -> [count, bytes, outlived the op]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = len(self.log.events)
        self.in_op = True
        out = func(*args, **(kwargs or {}))
        self.in_op = False
        outs = {t.untyped_storage().data_ptr() for t in _tensors(out)}
        for index in range(first, len(self.log.events)):
            ptr, nbytes = self.log.events[index]
            self.attributed += 1
            self.attributed_bytes += nbytes
            if ptr in outs:
                self.log.seen += 1
                continue
            entry = self.hidden.setdefault(str(func), [0, 0, 0])
            entry[0] += 1
            entry[1] += nbytes
            entry[2] += self.log.live.get(ptr) == index
        return out


class AllocationLog:
    """Python callbacks recording every counted allocation (pointer, bytes) and which are live."""

    def __init__(self):
        self.events: list[tuple[int, int]] = []
        self.live: dict[int, int] = {}  # pointer -> index of the allocation that holds it
        self.seen = 0

    def alloc(self, ptr, nbytes):
        self.live[ptr] = len(self.events)
        self.events.append((ptr, -(-nbytes // 512) * 512))

    def free(self, ptr):
        self.live.pop(ptr, None)


def _tensors(obj) -> list:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tensors(x)]
    return []


def check_hidden(native, batches, make=build, top_n=6) -> tuple[list[list], list[list]]:
    """Allocations of one steady-state step of the plain loop that no dispatch mode sees, and the
    peaks the two mechanisms measure on such steps."""
    model = make()
    model.train()
    opt = adamw(model.parameters())
    plain_step(model, opt, batches[0])  # optimizer state exists: a steady step
    log = AllocationLog()
    recorder = _Recorder(log)
    with counting(native, callbacks=(log.alloc, log.free)), recorder:
        plain_step(model, opt, batches[1])
    total = len(log.events)
    hidden = sum(v[0] for v in recorder.hidden.values())
    hidden_bytes = sum(v[1] for v in recorder.hidden.values())
    outlived = sum(v[2] for v in recorder.hidden.values())
    top = sorted(recorder.hidden.items(), key=lambda kv: -kv[1][1])[:top_n]
    rows = [["allocations in one step (counted by the allocator)", f"{total}, "
             f"{sum(n for _, n in log.events) / 2**20:.2f} MiB"],
            ["... returned by an op as an output (a mode sees them)", f"{log.seen}"],
            ["... made inside an op, not its output (a mode cannot see)",
             f"{hidden}, {hidden_bytes / 2**20:.2f} MiB; {outlived} still live when the op "
             f"returned"],
            ["... outside any op (between the mode's calls)", f"{total - recorder.attributed}, "
             f"{(sum(n for _, n in log.events) - recorder.attributed_bytes) / 2**20:.2f} MiB"]]
    rows += [[f"    hidden in {name}", f"{c} x, {b / 2**10:.1f} KiB, {o} outlived the op"]
             for name, (c, b, o) in top]
    # the peaks of steady steps: both mechanisms at once (each counts only what the step makes),
    # then the allocator alone (a dispatch mode changes what a step allocates)
    with counting(native), autofit.simulate_gpu() as gpu:
        plain_step(model, opt, batches[2])
        sim_peak, sim_live = gpu.max_memory_allocated(), gpu.memory_allocated()
        sim_n = gpu.allocation_count
        both = native.stats()
    with counting(native):
        plain_step(model, opt, batches[3])
        alone = native.stats()
    peaks = [["simulate_gpu() (dispatch mode)", sim_n, sim_peak, sim_live],
             ["counting allocator, during the same step", both["allocations"], both["peak"],
              both["live"]],
             ["counting allocator, next step, no dispatch mode", alone["allocations"],
              alone["peak"], alone["live"]],
             ["allocator alone / simulate_gpu()", f"{alone['allocations'] / sim_n:.2f}",
              f"{alone['peak'] / sim_peak:.4f}", ""]]
    return rows, peaks


# -- costs ----------------------------------------------------------------------------------------

def per_op_cost(native, rounds: int = 7, n: int = 3000) -> list[list]:
    """us of process time per op, best of `rounds`, above no mode (overhead.py's table 4)."""
    x, y = torch.randn(64, 64), torch.randn(64, 64)
    z = x + y

    def new_tensor():
        for _ in range(n):
            x + y

    def view():
        for _ in range(n):
            z.view(-1)

    def best(work, context) -> float:
        times = []
        for _ in range(rounds):
            with context():
                t0 = time.process_time()
                work()
                times.append(time.process_time() - t0)
        return min(times) / n * 1e6

    @contextlib.contextmanager
    def installed_off():
        with counting(native):
            native.enable(False)
            yield

    def variant(name):
        factory = VARIANTS[name]
        return lambda: counting(native, callbacks=factory() if factory else None)

    contexts = {"no mode": contextlib.nullcontext, "no-op dispatch mode": _NoOpMode,
                "simulate_gpu()": autofit.simulate_gpu,
                "allocator installed, this thread off": installed_off,
                "(a) allocator, C++ counter": variant("a"),
                "(b0) allocator, empty Python call per alloc/free": variant("b0"),
                "(b) allocator, Python call feeding the allocator model": variant("b")}
    cost = {name: (best(new_tensor, c), best(view, c)) for name, c in contexts.items()}
    base = cost["no mode"]
    return [[name, a, b, a - base[0], b - base[1]] for name, (a, b) in cost.items()]


def step_cost(native, batches, warmup: int, repeats: int) -> list[list]:
    methods = {"plain loop, plain CPU": run_plain,
               "plain loop again (A/A: noise)": run_plain,
               "plain loop, no-op dispatch mode": run_plain_noop_mode,
               "plain loop, simulate_gpu()": lambda b: run_plain(b, gpu_budget=None),
               "allocator installed, this thread off": lambda b: run_native(native, b, None),
               "(a) allocator, C++ counter": lambda b: run_native(native, b, "a"),
               "(b0) allocator, empty Python call": lambda b: run_native(native, b, "b0"),
               "(b) allocator, Python call + allocator model": lambda b: run_native(native, b, "b")}
    times, _ = measure(methods, batches, warmup, repeats)
    names = list(methods)
    rows = [ratio_row(n, times, names[0]) for n in names]
    for row in rows:
        row[-1] = f"{paired(times, row[0], names[3], 'cpu'):.3f}"
    rows[0][-1] = "baseline"
    return rows


# -- the run --------------------------------------------------------------------------------------

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="measured steps per repeat")
    parser.add_argument("--warmup", type=int, default=5, help="steps before measuring, per repeat")
    parser.add_argument("--cold", action="store_true",
                        help="build into a fresh directory to time a cold compile")
    args = parser.parse_args(argv)
    setup()
    print_environment("counting through the CPU allocator: a prototype")
    missing = missing_tools()
    if missing:
        print(f"SKIPPED: missing on this machine: {'; '.join(missing)}. The prototype is built "
              f"with torch.utils.cpp_extension.load_inline; nothing was measured.")
        return 0
    started = time.perf_counter()
    directory = tempfile.mkdtemp(prefix="autofit-native-alloc-") if args.cold else build_dir()
    cold = not os.path.exists(os.path.join(directory, f"{NAME}.so"))
    t0 = time.perf_counter()
    try:
        native = load(directory)
    except Exception as e:  # noqa: BLE001 (a compiler that cannot build it: say why, stop)
        print(f"SKIPPED: the extension did not build in {directory}: {type(e).__name__}: "
              f"{str(e)[-600:]}")
        return 0
    first = time.perf_counter() - t0
    cached = cached_load_seconds(directory)
    print("Table 1. compile (load_inline, Python.h + c10/core/CPUAllocator.h + "
          "c10/util/Exception.h, -O2)")
    print(table(["build", "seconds", "note"], [
        ["cold (fresh build directory)", first if cold else "-",
         directory if cold else "built by an earlier run; --cold times one"],
        ["cached (a new process, built already)", cached, "load_inline's hash check + import"]]))
    print()

    batches = cls_batches(args.warmup + args.steps + 1, rows=BATCH, seq=SEQ, vocab=VOCAB)
    checks = (check_oom(native) + check_swaps(native, directory) + check_lifetimes(native)
              + check_storages(native) + check_threads(native, batches) + check_workers(native))
    hidden, peaks = check_hidden(native, batches)
    lm_hidden, lm_peaks = check_hidden(native, lm_batches(4, rows=BATCH, seq=SEQ, vocab=VOCAB),
                                       lambda: gpt2(hidden=128, layers=2, seq=SEQ, vocab=VOCAB), 3)
    print("Table 2. checks of the mechanism; then one steady step of overhead.py's loop (BERT) and "
          "of a GPT-2 LM (hidden 128, 2 layers, same batch and seq) under a recording mode")
    print(table(["check", "result"], checks + [["-- BERT (overhead.py's step)", ""]] + hidden
                + [["-- GPT-2 LM", ""]] + lm_hidden))
    print()
    for name, rows in (("overhead.py's BERT", peaks), ("the GPT-2 LM", lm_peaks)):
        print(f"Table 2b. steady steps of {name}: allocations and peaks (each counter counts only "
              f"what the step allocates)")
        print(table(["counter", "allocations", "peak bytes", "live at the end, bytes"], rows))
        print()

    print("Table 3. cost per op (us of process time, best of 7 rounds of 3000 ops)")
    print(table(["context", "x + y (new tensor)", "z.view(-1)", "added: new tensor", "added: view"],
                per_op_cost(native)))
    print()
    rows = step_cost(native, batches, args.warmup + 1, args.repeats)
    print(f"Table 3b. cost per step, overhead.py's model and plain loop ({args.repeats} paired "
          f"repeats of {args.warmup + 1} warm-up + {args.steps} steps); ratio = row / plain loop; "
          f"goal <= 1.2")
    print(table(["loop", "CPU ms/step", "best CPU ms", "ratio (CPU)", "wall ms/step",
                 "ratio (wall)", "/ simulate_gpu (CPU)"], rows))
    print(f"\ntotal wall time {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
