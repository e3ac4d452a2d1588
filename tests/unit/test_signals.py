"""SIGINT / SIGTERM as a stop request: deferred inside the training loop, at once elsewhere."""

from __future__ import annotations

import os
import signal

import pytest

from pjray.signals import Interrupted, StopRequest


def send(signum: int) -> None:
    os.kill(os.getpid(), signum)  # delivered to the main thread before os.kill returns to Python


def test_outside_deferred_a_signal_stops_at_once():
    with StopRequest():
        with pytest.raises(Interrupted) as err:
            send(signal.SIGTERM)
    assert err.value.exit_code == 143 and err.value.message == "interrupted (SIGTERM)"
    assert isinstance(err.value, KeyboardInterrupt)  # cleanup code written for Ctrl-C runs too


def test_inside_deferred_the_first_signal_is_a_request_the_second_stops_at_once():
    with StopRequest() as stop:
        with stop.deferred():
            send(signal.SIGINT)
            assert stop.requested and stop.signum == signal.SIGINT
            with pytest.raises(Interrupted) as err:
                send(signal.SIGINT)
        assert err.value.exit_code == 130


def test_the_previous_handlers_come_back():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with StopRequest():
        assert signal.getsignal(signal.SIGTERM) != before[signal.SIGTERM]
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_signal_swallowed_on_its_way_is_raised_again_before_the_loop():
    """Python drops an exception raised while it runs a `__del__`: a Ctrl-C during set-up that
    lands there would be lost. The request is kept and raised on entering `deferred()`."""

    class Swallows:
        def __del__(self) -> None:
            send(signal.SIGINT)  # the handler raises here, and Python ignores it

    with StopRequest() as stop:
        holder = Swallows()
        del holder  # "Exception ignored in ... Interrupted": set-up goes on
        assert stop.requested
        with pytest.raises(Interrupted) as err:
            with stop.deferred():
                raise AssertionError("the loop must not start")
    assert err.value.exit_code == 130
