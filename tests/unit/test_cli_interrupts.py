"""Ctrl-C during the ``ember`` command's own exit (`ember.cli._Interrupts`): a press that lands on any line of the
exit path, after the command has reported its interruption, is ignored; none escapes as a traceback.

The case that showed it: under CPU load, the second Ctrl-C of tests/reliability/test_expected_errors.py's "Ctrl-C
twice" sometimes arrived as `main`'s ``finally`` entered `_Interrupts.end`, before ``ended`` was set: the process
printed a `KeyboardInterrupt` traceback and died of the signal (exit -2) instead of exiting 130. Here a press
arrives at each line `end` executes, one press per run, so every instant of the window is tried: the handler is
called with `end`'s frame, as Python calls it for a signal that comes while that frame runs (a signal sent from
a trace function would be handled in the trace function's own frame instead).
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest

from ember import cli

pytestmark = pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(), reason="signals reach the main thread only"
)


def _lines_of_end(interrupts: cli._Interrupts) -> int:
    """How many trace events (the call, then each line) one `end()` executes."""
    count = 0

    def tracer(frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        nonlocal count
        if frame.f_code is cli._Interrupts.end.__code__ and event in ("call", "line"):
            count += 1
        return tracer

    sys.settrace(tracer)
    try:
        interrupts.end()
    finally:
        sys.settrace(None)
    return count


def _end_with_ctrl_c_at(interrupts: cli._Interrupts, at: int) -> None:
    """`interrupts.end()`, with a Ctrl-C at its `at`-th trace event: whatever handler is installed then, called
    with `end`'s frame (what it raises comes out of `end`)."""
    seen = 0

    def tracer(frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        nonlocal seen
        if frame.f_code is cli._Interrupts.end.__code__ and event in ("call", "line"):
            seen += 1
            if seen == at:
                handler = signal.getsignal(signal.SIGINT)
                if callable(handler):
                    handler(signal.SIGINT, frame)
        return tracer

    sys.settrace(tracer)
    try:
        interrupts.end()
    finally:
        sys.settrace(None)


@pytest.mark.parametrize("at_exit", [True, False], ids=["the command", "main(argv) in a process"])
def test_a_ctrl_c_on_any_line_of_the_exit_path_is_ignored(at_exit: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    registered: list[tuple[Any, ...]] = []
    monkeypatch.setattr(cli.atexit, "register", lambda *args: registered.append(args))  # not at this test's exit
    previous = signal.getsignal(signal.SIGINT)
    try:
        events = _lines_of_end(cli._Interrupts({cli.main.__code__}, at_exit=at_exit))
        assert events >= 3
        # for the command: every event; in a process (at_exit False) the last line puts the caller's handler
        # back, after which a Ctrl-C is the caller's again (pytest's: KeyboardInterrupt), so up to before it
        last = events if at_exit else events - 1
        escaped = []
        for at in range(1, last + 1):
            try:  # (a KeyboardInterrupt left to pytest would end the whole session, not fail this test)
                _end_with_ctrl_c_at(cli._Interrupts({cli.main.__code__}, at_exit=at_exit), at)
            except KeyboardInterrupt:
                escaped.append(at)
        assert escaped == [], f"a Ctrl-C at these trace events of end() escaped: {escaped} of {events}"
    finally:
        signal.signal(signal.SIGINT, previous)
    assert bool(registered) == at_exit  # the command ignores Ctrl-C through the interpreter's exit


@pytest.mark.parametrize("at_exit", [True, False], ids=["the command", "main(argv) in a process"])
def test_a_handler_set_outside_python_is_replaced_and_then_released(
    at_exit: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process whose Ctrl-C handler was set outside Python (`signal.signal` returns None for it): the command
    still ignores Ctrl-C through its exit, and `main(argv)` in a process leaves Python's own handler, not its
    ended one, which would swallow every later Ctrl-C."""
    registered: list[tuple[Any, ...]] = []
    monkeypatch.setattr(cli.atexit, "register", lambda *args: registered.append(args))
    installed: list[Any] = []
    monkeypatch.setattr(cli.signal, "getsignal", lambda signum: None)
    monkeypatch.setattr(cli.signal, "signal", lambda signum, handler: installed.append(handler))  # returns None
    interrupts = cli._Interrupts({cli.main.__code__}, at_exit=at_exit)
    interrupts.end()
    assert installed[0] == interrupts._handle
    if at_exit:
        assert [args[1:] for args in registered] == [(signal.SIGINT, signal.SIG_IGN)] and len(installed) == 1
    else:
        assert registered == [] and installed[1:] == [signal.default_int_handler]
