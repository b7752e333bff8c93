"""Ranged GETs straight into the caller's buffers: the ranges of one call (a bucket's) joined where they touch,
cut into pieces of PIECE_BYTES at most, up to CONCURRENT_GETS of them in flight; each piece paced (--max-gbps),
read from the node cache where it holds it, else fetched with If-Match the planned ETag and written through to
the cache. Memory: the caller's buffers and one BODY_CHUNK per GET in flight, nothing else.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from distload.errors import CheckpointError

from .cache import NodeCache
from .client import ObjectChanged, Store
from .pace import Pacer
from .url import ObjectVersion

# Pieces of 8-16 MiB, 4 in flight, were the fastest ranged GETs measured per client, and 4 MiB pieces halved a
# load's requests against 1 MiB ones (BENCHMARKS.md, "Object storage"): a range is cut into CONCURRENT_GETS pieces,
# none smaller than MIN_PIECE_BYTES (but the last) or larger than PIECE_BYTES.
PIECE_BYTES = 8 << 20
MIN_PIECE_BYTES = 4 << 20
CONCURRENT_GETS = 8


def pieces(start: int, end: int, concurrency: int = CONCURRENT_GETS) -> list[tuple[int, int]]:
    """[start, end) cut into at most `concurrency` pieces, each MIN_PIECE_BYTES..PIECE_BYTES (the last smaller)."""
    size = min(PIECE_BYTES, max(MIN_PIECE_BYTES, -(-(end - start) // concurrency)))
    return [(a, min(a + size, end)) for a in range(start, end, size)]


def joined(requests) -> list[tuple[ObjectVersion, int, list[memoryview]]]:
    """(object, offset, view) requests as runs (object, start, views): consecutive ranges of one object that
    touch are one run (one GET fills them all)."""
    runs = []
    for obj, offset, view in requests:
        if not len(view):
            continue
        if runs and runs[-1][0] == obj and runs[-1][1] + sum(len(v) for v in runs[-1][2]) == offset:
            runs[-1][2].append(view)
        else:
            runs.append((obj, offset, [view]))
    return runs


def slices(start: int, views: list[memoryview], a: int, b: int) -> list[memoryview]:
    """The parts of `views` (object bytes from `start` on) that hold object bytes [a, b)."""
    out, base = [], start
    for view in views:
        lo, hi = max(a, base), min(b, base + len(view))
        if lo < hi:
            out.append(view[lo - base:hi - base])
        base += len(view)
    return out


class Fetcher:
    """One process's ranged GETs (store), through its node's cache (None: no --cache-dir), paced (pacer)."""

    def __init__(self, store: Store, cache: NodeCache | None, pacer: Pacer, concurrency: int = CONCURRENT_GETS):
        self.store, self.cache, self.pacer, self.concurrency = store, cache, pacer, concurrency
        self.bytes_fetched = self.bytes_cached = 0
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def fetch(self, requests) -> None:
        """Fill each (object, offset, view) of `requests` with the object's bytes at offset."""
        jobs = []
        for obj, start, views in joined(requests):
            end = start + sum(len(v) for v in views)
            parts = self.cache.parts(obj, start, end) if self.cache is not None else [(start, end, None)]
            for a, b, span in parts:
                if span is not None:
                    jobs.append((self._from_cache, obj, span, a, slices(start, views, a, b)))
                else:
                    jobs += [(self._from_store, obj, None, pa, slices(start, views, pa, pb))
                             for pa, pb in pieces(a, b, self.concurrency)]
        if len(jobs) == 1:
            fn, *args = jobs[0]
            fn(*args)
            return
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="distload-get")
        futures = [self._pool.submit(fn, *args) for fn, *args in jobs]
        for f in futures:   # all done before raising: no GET may still write into the caller's buffers
            f.exception()
        for f in futures:
            f.result()

    def _from_store(self, obj: ObjectVersion, _span, start: int, views: list[memoryview]) -> None:
        n = sum(len(v) for v in views)
        self.pacer.wait(n)
        try:
            self.store.get_into(obj, start, views)
        except ObjectChanged:
            if self.cache is not None:
                self.cache.forget(obj)
            now = self.store.head(obj.key)
            raise ObjectChanged(
                f"s3://{self.store.url.bucket}/{obj.key} changed on the server during the load: ETag {obj.etag} "
                f"when the load was planned, {now.etag if now else 'deleted'} now; every range is asked for with "
                f"If-Match the planned ETag, so nothing of two versions was mixed: load again once the upload is "
                f"complete") from None
        with self._lock:
            self.bytes_fetched += n
        if self.cache is not None:
            self.cache.put(obj, start, views)

    def _from_cache(self, obj: ObjectVersion, span: tuple[int, int], start: int, views: list[memoryview]) -> None:
        try:
            self.cache.read_into(obj, span, start, views)
        except OSError:   # removed since it was listed (another load saw a new version): fetch it
            self._from_store(obj, None, start, views)
            return
        with self._lock:
            self.bytes_cached += sum(len(v) for v in views)

    def read_bytes(self, obj: ObjectVersion, start: int, end: int) -> bytes:
        """Bytes [start, end) of the object (discovery's small reads)."""
        if end > obj.size or start < 0 or start > end:
            raise CheckpointError(f"s3://{self.store.url.bucket}/{obj.key}: bytes {start}-{end} are outside its "
                                  f"{obj.size} bytes")
        out = bytearray(end - start)
        self.fetch([(obj, start, memoryview(out))])
        return bytes(out)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
