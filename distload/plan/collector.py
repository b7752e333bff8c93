"""The cyclic garbage collector paused while planning.

A plan is a few hundred thousand small long-lived objects (pieces, shares, chunks, buckets; an MoE
checkpoint's experts make most of them) and no reference cycles: every full collection the allocations
trigger walks all of them and frees nothing. Pausing the collector for the pure planning call, and
restoring it after, leaves the objects to reference counting, which frees them as before.
"""

from __future__ import annotations

import functools
import gc


def collector_paused(fn):
    """Decorator: run `fn` with the cyclic collector off (restored as it was, also when fn raises)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not gc.isenabled():
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()
    return wrapper
