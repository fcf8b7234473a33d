"""Ctrl-C held while an update is being applied, so it is applied whole.

Python raises KeyboardInterrupt between two bytecodes wherever the main thread is. Inside an
optimizer step that runs without a snapshot (a step known to fit), or while an offloaded update is
written back to the device, that leaves the parameters and the state half-way: some updated, some
not. While `SigintHold` holds, SIGINT is only recorded; `deliver()` hands it afterwards to the
handler that was there before (Python's default raises KeyboardInterrupt), once the update is whole.

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

    def __enter__(self) -> "SigintHold":
        self.holding, self.caught = False, False
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.getsignal(signal.SIGINT)
            self._installed = True  # before: a Ctrl-C right after the install finds it set
            signal.signal(signal.SIGINT, self._handler)
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
            _call(self._previous, signal.SIGINT, None)


def _call(handler, signum, frame) -> None:
    if callable(handler):
        handler(signum, frame)
    elif handler == signal.SIG_IGN:
        return
    elif handler == signal.SIG_DFL:
        signal.raise_signal(signum)  # the default action: the process ends, as it would have
    else:  # None: a handler not installed from Python; Python's own default
        signal.default_int_handler(signum, frame)
