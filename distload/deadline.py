"""A bound on work that runs on this rank alone (planning): past `seconds`, it stops with an error naming
the option, on every rank that reaches the bound, so a job never plans for longer than its --timeout.

Collectives are bounded by the process group's own timeout; pure Python work is not, and a config.json or
index that makes planning slow would otherwise keep every rank busy with no word. SIGALRM interrupts the
main thread between bytecodes; off the main thread (or without SIGALRM) the work runs unbounded, as before.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading

from .errors import PlanError


class DeadlineExceeded(PlanError):
    """The bounded work ran past its seconds."""


@contextlib.contextmanager
def within(seconds: float | None, what: str, option: str = "--timeout"):
    """Run the body within `seconds` (None or inf: unbounded); past them raise DeadlineExceeded naming
    `what` and `option`."""
    usable = (seconds is not None and math.isfinite(seconds) and seconds > 0 and hasattr(signal, "SIGALRM")
              and threading.current_thread() is threading.main_thread())
    if not usable:
        yield
        return

    def expired(signum, frame):
        raise DeadlineExceeded(f"{what} took longer than {option} {seconds:g} s; the checkpoint's index or "
                               f"config.json asks for more work than it should (check them), or raise {option}")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
