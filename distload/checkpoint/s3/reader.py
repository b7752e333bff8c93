"""The Reader of a load's transfer over object storage: each read_many (a bucket's ranges) is one Fetcher call,
its ranges fetched at once as concurrent ranged GETs straight into the staging buffers and params."""

from __future__ import annotations

import threading

from ..file_reads import as_byte_view
from .cache import NodeCache
from .client import Store
from .fetch import Fetcher
from .listing import ObjectIndex
from .pace import Pacer
from .url import ObjectUrl


class ObjectReader:
    """Reads the weight files of `index` from the store (through the node cache under `cache_dir`, if given),
    fetching at most `rate` bytes/s (None: no cap)."""

    strategy = None   # no file-system read strategy applies: ranged GETs

    def __init__(self, index: ObjectIndex, cache_dir: str | None = None, rate: float | None = None):
        url = ObjectUrl.parse(index.root)
        store = Store(url)
        cache = NodeCache(cache_dir, store.endpoint, url.bucket) if cache_dir else None
        self.fetcher = Fetcher(store, cache, Pacer(rate))
        self.objects = index.objects
        self.bytes_read = 0
        self.files_opened: set[str] = set()
        self._lock = threading.Lock()

    def read_into(self, file: str, offset: int, out, /) -> int:
        return self.read_many([(file, offset, out)])

    def read_many(self, ranges, /) -> int:
        """Fill every (file, offset, out) of `ranges`; returns the bytes read."""
        requests = [(self.objects[f], offset, as_byte_view(out)) for f, offset, out in ranges]
        self.fetcher.fetch(requests)
        n = sum(len(view) for _, _, view in requests)
        with self._lock:
            self.bytes_read += n
            self.files_opened.update(f for f, _, _ in ranges)
        return n

    def prefetch(self, file: str, offset: int, nbytes: int, /) -> None:
        """Nothing: a range is fetched when it is read (the transfer's read-ahead thread reads the next bucket
        while this one is sent), so that no byte is fetched twice or held beyond the staging buffers."""

    def stats(self) -> dict:
        """This reader's traffic with the store and its node cache (the report's per-rank `object_store`)."""
        f, cache = self.fetcher, self.fetcher.cache
        return {"requests": f.store.requests, "retries": f.store.retries, "bytes_fetched": f.bytes_fetched,
                "bytes_from_cache": f.bytes_cached, "bytes_to_cache": cache.bytes_written if cache else 0,
                "paced_s": round(f.pacer.waited, 3), "rate_cap_bytes_per_s": f.pacer.rate}

    def close(self) -> None:
        self.fetcher.close()
