"""The progress bar of a load: one line on rank 0, bytes and GB/s; silent when stderr is not a terminal."""

from __future__ import annotations

import sys
import time


class Progress:
    """A one-line progress bar on rank 0 for long loads; silent when stderr is not a TTY."""

    def __init__(self, total_bytes: int, enabled: bool):
        self.total, self.done = max(total_bytes, 1), 0
        self.enabled = enabled and sys.stderr.isatty()
        self.start = time.perf_counter()

    def __call__(self, bucket) -> None:
        self.done += bucket.read_bytes
        if not self.enabled:
            return
        frac = self.done / self.total
        elapsed = time.perf_counter() - self.start
        bar = "#" * int(30 * frac)
        sys.stderr.write(f"\rdistload [{bar:<30}] {frac:6.1%} {self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB "
                         f"{self.done / 1e9 / max(elapsed, 1e-9):.2f} GB/s")
        if self.done >= self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()
