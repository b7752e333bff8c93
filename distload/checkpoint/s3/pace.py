"""The bandwidth cap (--max-gbps, per job): each reader of the job gets an equal share, and paces its GETs so that
what it asks the store for never runs ahead of that rate (pure: the clock and the sleep are given)."""

from __future__ import annotations

import threading
import time

BITS_PER_BYTE = 8


def reader_share(max_gbps: float | None, readers: int) -> float | None:
    """Bytes per second one of the job's `readers` may fetch under a cap of `max_gbps` gigabits/s (None: no cap)."""
    if max_gbps is None:
        return None
    return max_gbps * 1e9 / BITS_PER_BYTE / max(1, readers)


class Pacer:
    """Spaces requests so that bytes asked for over any stretch stay within `rate` bytes/s: a request of n bytes
    starts no earlier than the previous one's start plus its n / rate seconds."""

    def __init__(self, rate: float | None, clock=time.monotonic, sleep=time.sleep):
        self.rate, self.clock, self.sleep = rate, clock, sleep
        self.next_start = None
        self.waited = 0.0           # seconds requests were held back (the report's)
        self._lock = threading.Lock()

    def wait(self, nbytes: int) -> float:
        """Block until a request of `nbytes` may start; returns the seconds held back."""
        if self.rate is None or nbytes <= 0:
            return 0.0
        with self._lock:
            now = self.clock()
            start = now if self.next_start is None else max(now, self.next_start)
            self.next_start = start + nbytes / self.rate
            delay = start - now
            self.waited += delay
        if delay > 0:
            self.sleep(delay)
        return delay
