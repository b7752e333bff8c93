"""Keep the cyclic garbage collector off the objects that existed before a load, for the load's duration.

A full collection walks every object the collector tracks, and right after `import torch` those are the
hundreds of thousands of objects torch made. In a fresh torchrun process the first full collection comes when
the load's first few hundred allocations overflow the young generations, that is inside the first plan, and
every rank waits for the slowest one's plan; in a process that loads again (refit, the benchmark) full
collections keep landing in loads now and then. BENCHMARKS.md has the measured cost.

`gc.freeze()` moves the objects that exist when a load starts into the permanent generation, so collections
during the load look only at what the load allocates; `gc.unfreeze()` hands them back when it ends, as they
were (the next full collection after the load sees them, as it would have). A process that froze objects
itself (`gc.get_freeze_count() > 0`) or turned the collector off is left as it is.
"""

from __future__ import annotations

import functools
import gc
from contextlib import contextmanager


@contextmanager
def earlier_objects_frozen():
    """For the body of the `with`: the collector skips the objects that existed when it began."""
    if not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def with_earlier_objects_frozen(fn):
    """Decorator: run `fn` inside earlier_objects_frozen()."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with earlier_objects_frozen():
            return fn(*args, **kwargs)
    return wrapper


def collector_paused(fn):
    """Decorator: run `fn` with the cyclic collector off (restored as it was, also when fn raises). For pure
    calls that make many small long-lived objects and no reference cycles (a plan's pieces, shares and buckets;
    an index's tensor entries): every full collection their allocations trigger walks them all and frees nothing,
    so they are left to reference counting, which frees them as before."""
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
