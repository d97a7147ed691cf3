"""Ctrl-C as one line, whatever it tears: the CLI's SIGINT handler records the interrupt
before raising KeyboardInterrupt, because an interrupt that lands inside a C extension's import
(numpy under torch) surfaces later as an unrelated ImportError, which should still read
"interrupted" and exit 130. An interrupt that lands while a module is being imported ends the
process at once instead: torch runs parts of its import from C++, and an exception raised
there aborts the process with a C++ traceback; an import writes nothing that needs undoing."""

from __future__ import annotations

import os
import signal
import sys
import threading

_received: list = []
IMPORT_FRAMES = ("<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>")


def _on_sigint(signum, frame):
    _received.append(signum)
    if _in_import(frame):
        sys.stderr.write("longattn: interrupted\n")
        sys.stderr.flush()
        os._exit(130)
    raise KeyboardInterrupt


def _in_import(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename in IMPORT_FRAMES:
            return True
        frame = frame.f_back
    return False


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
