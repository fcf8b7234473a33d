"""Ctrl-C held while an update is applied (engine/interrupts.py), with several runs open at once: a
GAN's two steppers share one handler, put back whatever order they close in."""

import signal

import pytest

from autofit.engine.interrupts import SigintHold


def _two_installed():
    """(the handler before, two runs' holds installed in turn)."""
    before = signal.getsignal(signal.SIGINT)
    first, second = SigintHold(), SigintHold()
    first.install()
    second.install()
    return before, first, second


@pytest.mark.parametrize("close_order", ["opened", "reversed"])
def test_two_runs_put_back_the_handler_before_them_in_either_order(close_order):
    before = signal.getsignal(signal.SIGINT)
    first, second = SigintHold(), SigintHold()
    for _ in range(3):  # alternate steps, as two steppers in one loop take them
        first.install()
        second.install()
    assert (first.installs, second.installs) == (1, 0)  # one handler, installed once for both
    assert signal.getsignal(signal.SIGINT) is not before
    for hold in ([first, second] if close_order == "opened" else [second, first]):
        hold.uninstall()
    assert signal.getsignal(signal.SIGINT) is before


def test_a_ctrl_c_while_one_run_holds_is_recorded_by_it_and_raised_at_its_delivery():
    before, first, second = _two_installed()
    second.hold()
    signal.raise_signal(signal.SIGINT)  # recorded, not raised: the update is being applied
    assert (first.caught, second.caught) == (False, True)
    second.release()
    with pytest.raises(KeyboardInterrupt):
        second.deliver()
    first.uninstall()
    assert signal.getsignal(signal.SIGINT) is before


def test_a_ctrl_c_nobody_holds_acts_at_once_and_takes_the_handler_away():
    before, first, second = _two_installed()
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before
    first.uninstall()
    second.uninstall()
    assert signal.getsignal(signal.SIGINT) is before
