"""A load's progress on rank 0, on every route: a bar on a terminal (bytes and the rate), log lines where an engine's
workers run (their output is no terminal: vLLM's log shows one line every LOG_EVERY_S), nothing otherwise (a pipe,
a file, --no-progress). Also the units every line of a load speaks in (a 7 MB checkpoint is not "0.000 GB").
"""

from __future__ import annotations

import sys
import time

BAR, LOG = "bar", "log"
LOG_EVERY_S = 5.0        # a log line at most this often (a load shorter than that logs only its summary)
REDRAW_EVERY_S = 0.1     # the bar at most this often, and once at the end
WIDTH = 30
UNITS = ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB"))


def unit_of(nbytes: float) -> tuple[float, str]:
    """(scale, name) of the decimal unit that shows `nbytes` with 1 to 3 digits before the point."""
    for scale, name in UNITS:
        if nbytes >= scale:
            return scale, name
    return 1.0, "B"


def size(nbytes: float, unit: tuple[float, str] | None = None) -> str:
    """'412.3 MB', '1.24 GB', '640 B' (in `unit` when given)."""
    scale, name = unit or unit_of(nbytes)
    value = nbytes / scale
    return f"{value:.0f} {name}" if name == "B" else f"{value:.{1 if value >= 100 else 2}f} {name}"


def rate(nbytes: float, seconds: float) -> str:
    """'0.93 GB/s', '41.5 MB/s'."""
    return f"{size(nbytes / seconds) if seconds > 0 else '-'}/s"


def mode_of(progress, rank: int, stream=None) -> str | None:
    """What rank `rank` shows for the `progress` option: True: a bar when stderr is a terminal, else nothing;
    "log": log lines (an engine's workers); False: nothing. Only rank 0 shows anything."""
    if rank != 0 or not progress:
        return None
    if progress == LOG:
        return LOG
    return BAR if (stream or sys.stderr).isatty() else None


class Progress:
    """One job's progress on rank 0 (mode: BAR, LOG or None); `advance(nbytes)` as bytes land, `close()` at the end."""

    def __init__(self, total_bytes: int, mode: str | None, what: str = "loading", stream=None):
        self.total, self.done, self.mode, self.what = max(total_bytes, 1), 0, mode, what
        self.stream = stream or sys.stderr
        self.unit = unit_of(self.total)
        self.start = self.shown = time.perf_counter()
        self.drawn = -1   # self.done when last shown

    def __call__(self, bucket) -> None:
        """A bucket has gone by (the bucketed transfer and node pulls walk the plan's buckets)."""
        self.advance(bucket.read_bytes)

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        if self.mode is None:
            return
        now = time.perf_counter()
        every = REDRAW_EVERY_S if self.mode == BAR else LOG_EVERY_S
        if now - self.shown >= every or (self.mode == BAR and self.done >= self.total):
            self.shown = now
            self.show(now)

    def line(self, now: float) -> str:
        """'82.3/382.8 MB (22%), 739.4 MB/s': both numbers in the total's unit and precision."""
        scale, name = self.unit
        digits = 0 if name == "B" else 1 if self.total / scale >= 100 else 2
        frac = min(self.done / self.total, 1.0)
        return (f"{self.done / scale:.{digits}f}/{self.total / scale:.{digits}f} {name} ({frac:.0%}), "
                f"{rate(self.done, now - self.start)}")

    def show(self, now: float) -> None:
        self.drawn = self.done
        if self.mode == LOG:   # a line of its own (an engine's logging may drop distload's logger)
            self.stream.write(f"distload: {self.what} {self.line(now)}\n")
            self.stream.flush()
            return
        frac = min(self.done / self.total, 1.0)
        bar = "#" * int(WIDTH * frac)
        self.stream.write(f"\rdistload [{bar:<{WIDTH}}] {self.line(now)}   ")
        self.stream.flush()

    def close(self) -> None:
        """End the bar's line (once it showed)."""
        if self.mode == BAR and self.done:
            if self.drawn != self.done:
                self.show(time.perf_counter())
            self.stream.write("\n")
            self.stream.flush()
            self.mode = None
