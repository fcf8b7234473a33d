"""Where each rank is and whether it is alive, kept in the default process group's store, so that a
rank that stalls or dies is named to the others on evidence, and a rank that stalled is stopped once
the others have given up on it.

Before each agreement a rank writes how many agreements it has entered and where it is (global step,
phase); a thread writes its heartbeat every POLL_S. When an agreement's collective fails, the rank
names only what it observed: a rank whose heartbeat stopped for DEAD_S died (or froze); when the
store itself stopped answering, the rank that serves it died; after the process group's timeout ran
out (not after a closed connection), a rank alive but behind stalled. A rank never names itself, and
a healthy rank that had not yet reached the agreement is not named. The failing rank then writes
that it stopped; the thread on every rank reads that each poll, and a rank still running (stalled in
forward, say) is interrupted in its main thread with the others' reason, so it ends too instead of
waking later into collectives no one answers. Everything here is best effort: without a store the
errors are gloo's own.
"""

from __future__ import annotations

import itertools
import signal
import threading
import time

from autofit.distributed import internals

_RUNS = itertools.count()  # every rank opens its runs' lockstep in the same order
POLL_S = 1.0               # how often the thread beats and reads whether another rank stopped
DEAD_S = 4.0               # a heartbeat that has not moved for this long: the process is gone
LOOK_S = 0.2               # how often a failed rank reads the others' heartbeats


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class Presence:
    def __init__(self, rank: int, world: int, describe):
        self.rank, self.world, self.describe = rank, world, describe  # describe(step, phase) -> str
        self.store = internals.default_store() if world > 1 else None
        self.host = internals.store_host() if self.store is not None else None  # serves the store
        self.lost = False   # the store stopped answering
        self.prefix = f"autofit/lockstep/{next(_RUNS)}/"
        self.entered = 0
        self.stopped = None  # the RankFailed this rank raises since another rank stopped
        self.waiting = False  # inside an agreement's collective: it ends by itself (the timeout)
        self.delivered = False  # `stopped` was raised in the main thread
        self._watch = None
        self._previous = None
        self._signals = False  # SIGUSR1 is this run's: the thread may interrupt the main thread
        self._last: dict = {}  # each rank's last record read (where it was), kept if the store goes

    def _set(self, key: str, value: str) -> None:
        if self.store is not None and not self.lost:
            try:
                self.store.set(self.prefix + key, value)
            except Exception:  # noqa: BLE001 - best effort
                self.lost = True

    def _get(self, key: str) -> str | None:
        if self.store is None or self.lost:
            return None
        try:
            if self.store.check([self.prefix + key]):
                return _text(self.store.get(self.prefix + key))
        except Exception:  # noqa: BLE001
            self.lost = True
        return None

    def enter(self, step: int, phase: int) -> None:
        """This rank is about to enter its next agreement, at `step` in `phase`."""
        self.entered += 1
        self._set(f"at/{self.rank}", f"{self.entered} {step} {phase}")

    def mark(self, step: int, phase: int) -> None:
        """Where this rank is between agreements (an attempt under way), for the others' errors."""
        self._set(f"at/{self.rank}", f"{self.entered} {step} {phase}")

    # -- after a failed agreement ----------------------------------------------------------------
    def _where(self, rank: int) -> tuple[int, str]:
        """(agreements entered, '; it was last at ...') of `rank`, from its record (the last read
        when the store has gone)."""
        record = self._get(f"at/{rank}")
        if record is not None:
            self._last[rank] = record
        record = self._last.get(rank)
        if record is None:
            return 0, "" if self.lost else "; it reached no agreement of this run"
        entered, step, phase = (int(float(x)) for x in record.split())
        return entered, f"; it was last {self.describe(step, phase)}"

    def _alive(self, others: list[int]) -> set[int]:
        """The ranks among `others` whose heartbeat moves within DEAD_S, or that left the run
        themselves (they ended it knowingly: not dead); a store that stops answering ends the
        watch."""
        def beats():
            return {r: self._get(f"beat/{r}") for r in others}
        first, alive = beats(), set()
        deadline = time.monotonic() + DEAD_S
        while len(alive) < len(others) and not self.lost and time.monotonic() < deadline:
            time.sleep(LOOK_S)
            now = beats()
            alive |= {r for r in others if (now[r] is not None and now[r] != first[r])
                      or self._get(f"left/{r}") is not None}
        return alive

    def _stopped_by_other(self) -> tuple[int, str] | None:
        """(failed rank, reason) when another rank already stopped the run naming a rank other
        than this one: its evidence, read before this rank's own."""
        text = self._get("stopped")
        if text is None:
            return None
        rank, failed, reason = text.split("|", 2)
        if int(rank) == self.rank or not failed or int(failed) == self.rank:
            return None
        return int(failed), reason

    def failed(self, timed_out: bool) -> list[tuple[int, str]]:
        """After this rank's agreement failed: the other ranks that the evidence shows failed, each
        with what was observed; never this rank. `timed_out`: the collective waited out the
        process group's timeout (a rank alive but behind stalled), rather than seeing a peer's
        connection close (a rank alive but behind is healthy, on its way)."""
        if self.store is None:
            return []  # no store, no evidence: no rank is named
        others = [r for r in range(self.world) if r != self.rank]
        self._set(f"failed/{self.rank}", "1")
        known = self._stopped_by_other()
        if known is not None:
            return [known]
        for r in others:
            self._where(r)  # kept, should the store go while the heartbeats are watched
        alive = self._alive(others)
        if self.lost:  # the store stopped answering: the rank serving it died
            if self.host is None or self.host == self.rank:
                return []
            return [(self.host, f"died: the store it serves closed its connection{self._where(self.host)[1]}")]
        named = []
        for r in others:
            entered, last = self._where(r)
            if r not in alive:
                named.append((r, f"died or froze: its heartbeat stopped{last}"))
            elif timed_out and entered < self.entered:
                named.append((r, f"stalled: its heartbeat goes on but it did not reach the agreement{last}"))
        return named

    def stop(self, failed: int | None, reason: str) -> None:
        """Tell every rank's watch that this rank gave up on the run, which rank failed (None:
        none is known to have) and why."""
        self._set(f"failed/{self.rank}", "1")
        self._set("stopped", f"{self.rank}|{'' if failed is None else failed}|{reason}")

    # -- the thread ------------------------------------------------------------------------------
    def watch(self, make_error) -> None:
        """Start the thread: it beats every POLL_S, and when another rank stopped it sets
        `stopped` to `make_error(stopping rank, failed rank or None, reason)`, raised in this
        process's main thread (when the run is in the main thread and SIGUSR1 is free; else at
        the next agreement)."""
        if self.store is None:
            return
        main = threading.main_thread()
        self._signals = False
        if threading.current_thread() is main and signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None):
            def interrupted(signum, frame):
                if self.stopped is not None and not self.waiting and not self.delivered:
                    self.delivered = True
                    raise self.stopped
            self._previous = signal.signal(signal.SIGUSR1, interrupted)  # never the user's own handler
            self._signals = True
        done = threading.Event()
        thread = threading.Thread(target=self._run, args=(done, make_error, main.ident),
                                  name="autofit-lockstep-watch", daemon=True)
        self._watch = (thread, done)
        thread.start()

    def _run(self, done: threading.Event, make_error, main: int) -> None:
        beat = 0
        while not self.delivered:
            self._set(f"beat/{self.rank}", str(beat))
            beat += 1
            self._poll(make_error, main)
            if done.wait(POLL_S):
                return

    def _poll(self, make_error, main: int) -> None:
        if self.stopped is None:
            text = self._get("stopped")
            if text is None:
                return
            rank, failed, reason = text.split("|", 2)
            if int(rank) == self.rank:
                return  # this rank stopped the run itself: it still beats for the others
            self.stopped = make_error(int(rank), int(failed) if failed else None, reason)
        # A rank waiting in an agreement ends there by itself; any other is interrupted
        # (again each poll, should the handler have run where its exception is ignored).
        if not self.waiting and self._signals:
            signal.pthread_kill(main, signal.SIGUSR1)

    def close(self) -> None:
        """Leave the run: say so (a rank that left is not dead), and when this rank serves the
        store and the run failed, keep serving it until every other rank left or DEAD_S passed,
        so that no rank reads a closed store as this rank's death."""
        if self._watch is None:
            return
        self._set(f"left/{self.rank}", "1")
        if self.rank == self.host and self._get("stopped") is not None:
            deadline = time.monotonic() + DEAD_S + POLL_S
            others = [r for r in range(self.world) if r != self.rank]
            while time.monotonic() < deadline and any(self._get(f"left/{r}") is None for r in others):
                time.sleep(LOOK_S)
        thread, done = self._watch
        done.set()
        thread.join()
        self._watch = None
        self.store = None  # no client of the job's store outlives the run through autofit
        if self._signals:
            signal.signal(signal.SIGUSR1, self._previous if self._previous is not None else signal.SIG_DFL)
            self._signals = False
