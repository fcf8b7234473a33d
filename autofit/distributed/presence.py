"""Where each rank is, kept in the default process group's store, so a rank that stalls or dies is
named to the others, and a rank that stalled is stopped once the others have given up on it.

Before each agreement a rank writes how many agreements it has entered and where it is (global step,
phase). When an agreement's collective fails (the process group's timeout ran out, or a peer's
connection closed), the rank reads the others' records: a rank that has entered fewer agreements
stalled or died before this one, and is named with where it last was; when none is behind, the
ranks that do not also report the failure within a few seconds are named (they died inside the
agreement). The failing rank then writes that it stopped; a watch thread on every rank reads that
once a second, and a rank still running (stalled in forward, say) is interrupted in its main thread
with the others' reason, so it ends too instead of waking later into collectives no one answers.
Everything here is best effort: without a store the errors are gloo's own.
"""

from __future__ import annotations

import itertools
import signal
import threading
import time

from autofit.distributed import internals

_RUNS = itertools.count()  # every rank opens its runs' lockstep in the same order
POLL_S = 1.0               # how often the watch reads whether another rank stopped
ANSWER_S = 3.0             # how long a failed rank waits for the others to report the failure too


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class Presence:
    def __init__(self, rank: int, world: int, describe):
        self.rank, self.world, self.describe = rank, world, describe  # describe(step, phase) -> str
        self.store = internals.default_store() if world > 1 else None
        self.prefix = f"autofit/lockstep/{next(_RUNS)}/"
        self.entered = 0
        self.stopped = None  # the RankFailed this rank raises since another rank stopped
        self.waiting = False  # inside an agreement's collective: it ends by itself (the timeout)
        self.delivered = False  # `stopped` was raised in the main thread
        self._watch = None
        self._previous = None

    def _set(self, key: str, value: str) -> None:
        if self.store is not None:
            try:
                self.store.set(self.prefix + key, value)
            except Exception:  # noqa: BLE001 - best effort
                self.store = None

    def _get(self, key: str) -> str | None:
        try:
            if self.store is not None and self.store.check([self.prefix + key]):
                return _text(self.store.get(self.prefix + key))
        except Exception:  # noqa: BLE001
            pass
        return None

    def enter(self, step: int, phase: int) -> None:
        """This rank is about to enter its next agreement, at `step` in `phase`."""
        self.entered += 1
        self._set(f"at/{self.rank}", f"{self.entered} {step} {phase}")

    def mark(self, step: int, phase: int) -> None:
        """Where this rank is between agreements (an attempt under way), for the others' errors."""
        self._set(f"at/{self.rank}", f"{self.entered} {step} {phase}")

    def absent(self) -> list[tuple[int, str]]:
        """After a failed agreement: the ranks that did not reach it, each with where it last was."""
        behind, level = [], []
        for r in range(self.world):
            if r == self.rank:
                continue
            record = self._get(f"at/{r}")
            if record is None:
                behind.append((r, "it reached no agreement of this run"))
                continue
            entered, step, phase = (int(float(x)) for x in record.split())
            if entered < self.entered:
                behind.append((r, f"it was last {self.describe(step, phase)}"))
            else:
                level.append(r)
        if behind or not level:
            return behind
        self._set(f"failed/{self.rank}", "1")
        deadline = time.monotonic() + ANSWER_S
        while level and time.monotonic() < deadline:
            level = [r for r in level if self._get(f"failed/{r}") is None]
            time.sleep(0.1)
        return [(r, "it did not answer after the agreement failed (it died inside it)") for r in level]

    def stop(self, reason: str) -> None:
        """Tell every rank's watch that this rank gave up on the run, and why."""
        self._set(f"failed/{self.rank}", "1")
        self._set("stopped", f"{self.rank}|{reason}")

    # -- the watch ---------------------------------------------------------------------------
    def watch(self, make_error) -> None:
        """Start the watch: when another rank stopped, `make_error(rank, reason)` is raised in this
        process's main thread (only when the run is in the main thread and SIGUSR1 is free)."""
        if self.store is None or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, None):
            return  # the user's own handler: never taken over

        def interrupted(signum, frame):
            if self.stopped is not None and not self.waiting and not self.delivered:
                self.delivered = True
                raise self.stopped
        self._previous = signal.signal(signal.SIGUSR1, interrupted)
        done = threading.Event()
        main = threading.main_thread().ident

        def run():
            while not done.wait(POLL_S) and not self.delivered:
                if self.stopped is None:
                    text = self._get("stopped")
                    if text is None:
                        continue
                    rank, _, reason = text.partition("|")
                    if int(rank) == self.rank:
                        return  # this rank stopped the run itself
                    self.stopped = make_error(int(rank), reason)
                # A rank waiting in an agreement ends there by itself; any other is interrupted
                # (again each poll, should the handler have run where its exception is ignored).
                if not self.waiting:
                    signal.pthread_kill(main, signal.SIGUSR1)
        thread = threading.Thread(target=run, name="autofit-lockstep-watch", daemon=True)
        self._watch = (thread, done)
        thread.start()

    def close(self) -> None:
        if self._watch is not None:
            thread, done = self._watch
            done.set()
            thread.join()
            self._watch = None
            signal.signal(signal.SIGUSR1, self._previous if self._previous is not None else signal.SIG_DFL)
