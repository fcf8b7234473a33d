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
"""

from __future__ import annotations

import signal
import threading


class SigintHold:
    """`with hold:` installs the recording handler (nothing is held yet: SIGINT acts as before);
    `hold.hold()` starts holding; leaving the block puts the previous handler back; `deliver()`
    then raises what was held, as the previous handler would have."""

    def __init__(self):
        self.holding = False
        self.caught = False
        self._previous = None
        self._installed = False
        self._bound = self._handler  # the object installed, to recognise it as still in place
        self.installs = 0  # handlers installed so far (tests: once per run, not per step)

    def install(self) -> None:
        """Install the recording handler and leave it in place (a run installs it once; each step
        then only holds and releases): nothing is done when it is still the handler in place.
        One installed since by someone else is kept as the handler to hand SIGINT to."""
        if threading.current_thread() is not threading.main_thread():
            return
        current = signal.getsignal(signal.SIGINT)
        if current is self._bound:  # still in place (or put back by another hold's uninstall)
            self._installed = True
            return
        self._previous = _beneath(current)
        self._installed = True  # before: a Ctrl-C right after the install finds it set
        self.installs += 1
        signal.signal(signal.SIGINT, self._bound)

    def release(self) -> None:
        """Stop holding (the handler stays installed): a Ctrl-C from now on acts at once."""
        self.holding = False

    def uninstall(self) -> None:
        """The handler before `install` back, unless another has replaced ours since."""
        if threading.current_thread() is not threading.main_thread():
            return  # (a finalizer run by another thread: signals are the main thread's)
        if self._installed and signal.getsignal(signal.SIGINT) is not self._bound:
            self._installed = False  # someone else's handler is in place: theirs stays
            return
        self._uninstall()

    def __enter__(self) -> "SigintHold":
        self.holding, self.caught = False, False
        if threading.current_thread() is threading.main_thread():
            self._previous = _beneath(signal.getsignal(signal.SIGINT))
            self._installed = True  # before: a Ctrl-C right after the install finds it set
            signal.signal(signal.SIGINT, self._bound)
        return self

    def hold(self) -> None:
        self.holding = True

    def _handler(self, signum, frame) -> None:
        if self.holding:
            self.caught = True
            return
        # Not holding: the previous handler's, and ours gone first (it may raise out of a block
        # whose exit would not run, __enter__ itself included).
        self._uninstall()
        _call(self._previous, signum, frame)

    def _uninstall(self) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)  # before the flag: see _handler
            self._installed = False

    def __exit__(self, *exc) -> None:
        self._uninstall()  # while still holding: a Ctrl-C meanwhile is recorded, for deliver()
        self.holding = False

    def deliver(self) -> None:
        """Raise the SIGINT held (if any) as the handler before the block would have."""
        if self.caught:
            self.caught = False
            self._uninstall()  # the interrupt ends the run: the handler before is in place for it
            _call(self._previous, signal.SIGINT, None)


def _beneath(handler):
    """The handler beneath any holds' handlers: the one the user (or Python) installed. Two runs
    whose steps alternate (a GAN's two steppers) each install over the other's handler; a hold
    that kept the other's as its previous would pass a Ctrl-C round the two for ever."""
    seen = set()
    while isinstance(getattr(handler, "__self__", None), SigintHold):
        if id(handler.__self__) in seen:  # (a cycle left by an older autofit: Python's default)
            return signal.default_int_handler
        seen.add(id(handler.__self__))
        handler = handler.__self__._previous
    return handler


def _call(handler, signum, frame) -> None:
    if callable(handler):
        handler(signum, frame)
    elif handler == signal.SIG_IGN:
        return
    elif handler == signal.SIG_DFL:
        signal.raise_signal(signum)  # the default action: the process ends, as it would have
    else:  # None: a handler not installed from Python; Python's own default
        signal.default_int_handler(signum, frame)
