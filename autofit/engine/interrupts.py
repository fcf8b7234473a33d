"""Ctrl-C held while an update is being applied, so it is applied whole.

Python raises KeyboardInterrupt between two bytecodes wherever the main thread is. Inside an
optimizer step that runs without a snapshot (a step known to fit), or while an offloaded update is
written back to the device, that leaves the parameters and the state half-way: some updated, some
not. While `SigintHold` holds, SIGINT is only recorded; `deliver()` hands it afterwards to the
handler that was there before (Python's default raises KeyboardInterrupt), once the update is whole.
A run installs the handler once (`install`, `uninstall` at its end) and each step only holds and
releases: a system call per step would be paid by every step that does not fail.

Only SIGINT is held, and only in the main thread (Python delivers signals there alone; elsewhere
nothing asynchronous interrupts the step). A second Ctrl-C while one is held is recorded too, not
escalated: the step being held is one optimizer update, short next to a user's patience.

Several runs may be open at once (a GAN's two steppers, an evaluation inside a run): they share one
process-wide handler (`_Shared`), installed by the first hold and put back when the last one is
closed, whatever order they close in; a SIGINT while any of them holds is recorded by each holding.
"""

from __future__ import annotations

import signal
import threading


class _Shared:
    """The one SIGINT handler autofit installs in this process and the holds that use it."""

    def __init__(self):
        self.holds: list = []   # the holds installed, in order (identity: a hold is a run's)
        self.previous = None    # the handler before ours, handed every SIGINT nobody holds

    def in_place(self) -> bool:
        return signal.getsignal(signal.SIGINT) is _handle

    def add(self, hold) -> bool:
        """`hold` among the installed; True when this installed the handler (it was not in place).
        One installed since by someone else is kept as the handler to hand SIGINT to."""
        if not any(h is hold for h in self.holds):
            self.holds.append(hold)  # before the handler: a Ctrl-C right after it finds the hold
        if self.in_place():
            return False
        self.previous = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGINT, _handle)
        return True

    def discard(self, hold) -> None:
        """`hold` no longer installed; the handler before ours back when no hold is left, unless
        another has replaced ours since (theirs stays)."""
        self.holds = [h for h in self.holds if h is not hold]
        if not self.holds and self.in_place():
            signal.signal(signal.SIGINT, self.previous)

    def installed(self, hold) -> bool:
        return any(h is hold for h in self.holds) and self.in_place()


_SHARED = _Shared()


def _handle(signum, frame) -> None:
    holding = [h for h in _SHARED.holds if h.holding]
    for hold in holding:
        hold.caught = True
    if holding:
        return
    # Nobody holds: the previous handler's, and ours gone first (it may raise out of a block whose
    # exit would not run, __enter__ itself included).
    previous = _SHARED.previous
    for hold in list(_SHARED.holds):
        _SHARED.discard(hold)
    _call(previous, signum, frame)


def _main_thread() -> bool:
    # Python delivers signals to the main thread alone (a finalizer may run in another).
    return threading.current_thread() is threading.main_thread()


class SigintHold:
    """`with hold:` installs the recording handler (nothing is held yet: SIGINT acts as before);
    `hold.hold()` starts holding; leaving the block puts the previous handler back; `deliver()`
    then raises what was held, as the previous handler would have."""

    def __init__(self):
        self.holding = False
        self.caught = False
        self.installs = 0  # handlers installed so far (tests: once per run, not per step)

    def install(self) -> None:
        """Install the recording handler and leave it in place (a run installs it once; each step
        then only holds and releases): nothing is done when it is still in place for this hold."""
        if _main_thread() and not _SHARED.installed(self) and _SHARED.add(self):
            self.installs += 1

    def release(self) -> None:
        """Stop holding (the handler stays installed): a Ctrl-C from now on acts at once."""
        self.holding = False

    def uninstall(self) -> None:
        """This hold's use of the handler ended; the handler before it back when it was the last."""
        if _main_thread():
            _SHARED.discard(self)

    def __enter__(self) -> "SigintHold":
        self.holding, self.caught = False, False
        if _main_thread():
            _SHARED.add(self)
        return self

    def hold(self) -> None:
        self.holding = True

    def __exit__(self, *exc) -> None:
        self.uninstall()  # while still holding: a Ctrl-C meanwhile is recorded, for deliver()
        self.holding = False

    def deliver(self) -> None:
        """Raise the SIGINT held (if any) as the handler before ours would have."""
        if self.caught:
            self.caught = False
            self.uninstall()  # the interrupt ends the run: the handler before is in place for it
            _call(_SHARED.previous, signal.SIGINT, None)


def _call(handler, signum, frame) -> None:
    if callable(handler):
        handler(signum, frame)
    elif handler == signal.SIG_IGN:
        return
    elif handler == signal.SIG_DFL:
        signal.raise_signal(signum)  # the default action: the process ends, as it would have
    else:  # None: a handler not installed from Python; Python's own default
        signal.default_int_handler(signum, frame)
