"""Rank 0's discovery of a checkpoint in object storage: list the prefix, fetch config.json and the index, and each
weight file's header by two ranged GETs (its first 8 bytes, then the header they announce), every one with If-Match
the ETag the listing gave. The index is then made exactly as for a directory (discover.index_checkpoint: the index
json is the authority, the header parser the same), and it carries the version of each object the load pins.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from distload.errors import CheckpointError
from distload.gc_freeze import collector_paused

from ..discover import CheckpointIndex, check_relative, index_checkpoint
from ..header import LENGTH_PREFIX_BYTES, entries_from_header, header_length
from .cache import NodeCache
from .client import Store
from .fetch import Fetcher
from .pace import Pacer
from .url import ObjectUrl, ObjectVersion

MAX_JSON_BYTES = 64 << 20   # config.json, the index: a few MB at most; more is not a checkpoint's
HEADER_FETCHES = 16         # weight files whose headers are fetched at once


@dataclass(frozen=True)
class ObjectIndex(CheckpointIndex):
    """A CheckpointIndex of objects: each weight file's planned version, and what discovery asked the store."""
    objects: dict[str, ObjectVersion] = field(default_factory=dict)
    discovery: dict = field(default_factory=dict)


class ObjectFiles:
    """The prefix of `url` as discover.index_checkpoint reads a checkpoint's files (DirectoryFiles' questions)."""

    def __init__(self, url: ObjectUrl, fetcher: Fetcher):
        self.url, self.root, self.fetcher = url, str(url), fetcher
        self.listed = fetcher.store.listing()
        if not self.listed:
            raise CheckpointError(f"{url}: no objects under this prefix at {fetcher.store.endpoint}; check the URL "
                                  f"(s3://BUCKET/PREFIX, the folder that holds config.json and the weights)")
        self.used: dict[str, ObjectVersion] = {}

    def names(self) -> list[str]:
        return sorted(self.listed)

    def where(self, name: str) -> str:
        return self.url.of(name)

    def read(self, name: str) -> bytes | None:
        obj = self.listed.get(name)
        if obj is None:
            return None
        if obj.size > MAX_JSON_BYTES:
            raise CheckpointError(f"{self.where(name)}: {obj.size} bytes, more than the {MAX_JSON_BYTES}-byte cap of a "
                                  f"config or index; not a checkpoint's file, remove or replace it")
        return self.fetcher.read_bytes(obj, 0, obj.size)

    def check_inside(self, rel: str, source: str) -> None:
        check_relative(self.root, rel, source)

    def entries(self, rels: list[str], fmt: str, sources: dict[str, str]) -> dict[str, dict]:
        if fmt != "safetensors":
            raise CheckpointError(f"{self.root}: a .bin/.pt checkpoint, which torch.load unpickles whole; distload "
                                  f"loads safetensors checkpoints from object storage: convert it to safetensors, or "
                                  f"download it and load the directory")
        with ThreadPoolExecutor(max(1, min(HEADER_FETCHES, len(rels))), thread_name_prefix="distload-head") as pool:
            return dict(zip(rels, pool.map(lambda rel: self._header(rel, sources[rel]), rels)))

    def _header(self, rel: str, source: str) -> dict:
        obj = self.listed.get(rel) or self.fetcher.store.head(self.url.key(rel))
        if obj is None:
            raise CheckpointError(f"{self.root}: {source} is missing (no object {self.where(rel)}); finish or repeat "
                                  f"the upload")
        self.used[rel] = obj
        prefix = self.fetcher.read_bytes(obj, 0, min(LENGTH_PREFIX_BYTES, obj.size))
        n = header_length(prefix, obj.size, rel)
        return entries_from_header(self.fetcher.read_bytes(obj, LENGTH_PREFIX_BYTES, LENGTH_PREFIX_BYTES + n),
                                   obj.size, rel)


@collector_paused  # an index is one entry object per tensor and no cycles (gc_freeze.py)
def discover_objects(url_text: str, cache_dir: str | None = None) -> ObjectIndex:
    """Index the checkpoint at s3://bucket/prefix (rank 0, before the rendezvous; the other ranks get the index)."""
    url = ObjectUrl.parse(url_text)
    store = Store(url)
    cache = NodeCache(cache_dir, store.endpoint, url.bucket) if cache_dir else None
    fetcher = Fetcher(store, cache, Pacer(None))
    try:
        files = ObjectFiles(url, fetcher)
        index = index_checkpoint(files)
    finally:
        fetcher.close()
    discovery = {"requests": store.requests, "retries": store.retries, "bytes_fetched": fetcher.bytes_fetched,
                 "bytes_from_cache": fetcher.bytes_cached}
    return ObjectIndex(index.root, index.format, index.tensors, index.files, index.ignored_files, index.config,
                       objects={rel: files.used[rel] for rel in index.files}, discovery=discovery)
