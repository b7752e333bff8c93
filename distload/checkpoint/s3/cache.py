"""The node cache (--cache-dir DIR): what a node fetched from the store stays on its local disk, so that the next
load on the node reads it there and the store sees no request for it.

DIR/<object>/<version>/<start>-<end>: one file per range fetched, under a folder per object (a hash of endpoint,
bucket and key) and per version of it (its ETag and size). A load serves only the version it planned, so a stale
range is never served; the first load that sees a new version removes the other versions' folders (the object
changed on the server). A range is written to a temporary name, flushed to disk and renamed: a file with a range's
name is always the whole range. A cache that cannot be written (a full disk) is left alone, with one warning: the
load goes on from the store.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import threading
from pathlib import Path

from .url import ObjectVersion

log = logging.getLogger("distload")

_SPAN = re.compile(r"([0-9a-f]{16})-([0-9a-f]{16})")


def version_name(obj: ObjectVersion) -> str:
    """A folder name for one version of an object: its ETag (made safe) and size."""
    tag = re.sub(r"[^0-9A-Za-z-]", "", obj.etag)
    if not tag or len(tag) > 100:
        tag = hashlib.sha256(obj.etag.encode()).hexdigest()[:32]
    return f"{tag}-{obj.size}"


def span_name(start: int, end: int) -> str:
    return f"{start:016x}-{end:016x}"


class NodeCache:
    """Ranges of the objects of one endpoint and bucket, on this node's disk under `root`."""

    def __init__(self, root: str, endpoint: str, bucket: str):
        self.root = Path(root)
        self.scope = f"{endpoint}\n{bucket}\n"
        self.writable = True
        self.bytes_written = 0
        self._spans: dict[ObjectVersion, list[tuple[int, int]]] = {}
        self._lock = threading.Lock()

    def folder(self, obj: ObjectVersion) -> Path:
        digest = hashlib.sha256((self.scope + obj.key).encode()).hexdigest()[:32]
        return self.root / digest / version_name(obj)

    def spans(self, obj: ObjectVersion) -> list[tuple[int, int]]:
        """The whole ranges [start, end) held for this version, sorted (read from the disk on first use)."""
        with self._lock:
            known = self._spans.get(obj)
            if known is None:
                known = self._spans[obj] = self._scan(obj)
            return list(known)

    def _scan(self, obj: ObjectVersion) -> list[tuple[int, int]]:
        folder = self.folder(obj)
        for other in (folder.parent.iterdir() if folder.parent.is_dir() else ()):
            if other.name != folder.name and not other.name.startswith(".tmp"):  # the object changed on the server
                shutil.rmtree(other, ignore_errors=True)
        found = []
        for path in (folder.iterdir() if folder.is_dir() else ()):
            m = _SPAN.fullmatch(path.name)
            if m:
                start, end = int(m.group(1), 16), int(m.group(2), 16)
                with contextlib.suppress(OSError):   # removed meanwhile: not held
                    if 0 <= start < end <= obj.size and path.stat().st_size == end - start:
                        found.append((start, end))
        return sorted(found)

    def parts(self, obj: ObjectVersion, start: int, end: int) -> list[tuple[int, int, tuple[int, int] | None]]:
        """[start, end) as consecutive parts (a, b, span): each either inside one cached span, or a gap (None)."""
        spans, parts, cursor = self.spans(obj), [], start
        while cursor < end:
            holding = [s for s in spans if s[0] <= cursor < s[1]]
            if holding:
                span = max(holding, key=lambda s: s[1])
                parts.append((cursor, min(span[1], end), span))
            else:
                parts.append((cursor, min((s[0] for s in spans if cursor < s[0] < end), default=end), None))
            cursor = parts[-1][1]
        return parts

    def read_into(self, obj: ObjectVersion, span: tuple[int, int], start: int, views: list[memoryview]) -> None:
        """Fill `views` with the bytes from `start` on, out of the cached `span` (OSError where it is gone: the
        caller fetches them instead)."""
        fd = os.open(self.folder(obj) / span_name(*span), os.O_RDONLY)
        try:
            _pread_all(fd, views, start - span[0])
        finally:
            os.close(fd)

    def put(self, obj: ObjectVersion, start: int, views: list[memoryview]) -> None:
        """Keep [start, start + len) of this version (the bytes just fetched into `views`)."""
        if not self.writable:
            return
        end = start + sum(len(v) for v in views)
        folder = self.folder(obj)
        tmp = folder / f".tmp-{os.getpid()}-{threading.get_ident()}-{span_name(start, end)}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                for view in views:
                    f.write(view)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, folder / span_name(start, end))
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            self.writable = False
            log.warning("--cache-dir %s: cannot write to it (%s); this load goes on without filling the cache",
                        self.root, e.strerror or e)
            return
        with self._lock:
            self._spans.setdefault(obj, []).append((start, end))
            self._spans[obj].sort()
            self.bytes_written += end - start

    def forget(self, obj: ObjectVersion) -> None:
        """Drop this version (it changed on the server during the load)."""
        with self._lock:
            self._spans.pop(obj, None)
        shutil.rmtree(self.folder(obj), ignore_errors=True)


def _pread_all(fd: int, views: list[memoryview], offset: int) -> None:
    views = [v for v in views if len(v)]
    while views:
        got = os.preadv(fd, views, offset)
        if got <= 0:
            raise OSError(f"cached span ended early at offset {offset}")
        offset += got
        while views and got >= len(views[0]):
            got -= len(views[0])
            views.pop(0)
        if views and got:
            views[0] = views[0][got:]
