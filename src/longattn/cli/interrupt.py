"""Ctrl-C as one line, whatever it tears: the CLI's SIGINT handler records the interrupt
before raising KeyboardInterrupt, because an interrupt that lands inside a C extension's import
(numpy under torch) surfaces later as an unrelated ImportError, which should still read
"interrupted" and exit 130."""

from __future__ import annotations

import signal
import threading

_received: list = []


def _on_sigint(signum, frame):
    _received.append(signum)
    raise KeyboardInterrupt


def install():
    """Route SIGINT through the recording handler; returns the handler to restore (or None
    where signals cannot be set: off the main thread, or a handler someone else installed)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.default_int_handler:
        return None
    signal.signal(signal.SIGINT, _on_sigint)
    return previous


def restore(previous) -> None:
    if previous is not None:
        signal.signal(signal.SIGINT, previous)


def received() -> bool:
    """Whether SIGINT reached this process since install()."""
    return bool(_received)
