"""Opt-in integrity checks: `--verify-checksums` (files against a `checksums` list) and `--check-finite`.

A truncated or bit-flipped file whose header still parses loads as a silently wrong model, and a
checkpoint saved after a diverged step holds NaN. Both checks cost a full pass over bytes, so they are
opt-in: the sha256 of each weight file, taken on the very bytes the transfer reads (HashingReader), and a
NaN/Inf scan of each rank's own params after it.

Why the hash is taken while reading: hashed in a pass of its own and read again by the transfer, a file
changed between the two passes is loaded and reported verified. `checksums` holds one whole-file sha256 per
file (what `sha256sum` writes), which needs the file's bytes in file order, and a reader may read only part
of a file (several readers share the buckets; a reader of one node skips the rows another node reads;
headers and tensors nobody loads are never read). So every reader keeps, for every file it reads, one
running sha256 over the whole file: what it reads for the transfer is hashed from the buffer it landed in
(the bytes that go to the ranks), and what it skips (the header, ranges another reader loads) it reads
itself only to hash. Each reader thus checks a whole-file sha256 that covers every byte it loaded, so any
byte loaded anywhere is covered by its reader's check; the price is that a file split over k readers is
read k times in all (the skipped ranges mostly from the page cache). A reader that reads a range again, or
goes back in a file, has loaded bytes its running hash has already passed: it cannot vouch for them and
says so (the load is refused; the transfer reads each reader's buckets in file order, so this does not
happen in a plan distload makes). Legacy torch.load files are unpickled whole in memory, so their bytes do
not come through read_into: they are hashed whole in a pass of their own, as files no reader touched are.
"""

from __future__ import annotations

import hashlib
import os
import re

import threading

import torch

from ..rules import names
from .legacy import is_legacy_file
from .reader import ReaderWrapper
from ..errors import CheckpointError

CHECKSUMS_FILE = "checksums"
_HASH_BLOCK = 8 << 20
_SCAN_ELEMENTS = 1 << 24  # scan in slices: a NaN check must not allocate a second copy of a large param
_LINE = re.compile(r"^([0-9a-fA-F]{64}) [ *](.+)$")  # sha256sum output: "<hex>  <file>" ("*" in binary mode)


def read_checksums(root: str) -> dict[str, str]:
    """file (relative to root) -> sha256 hex, from `root/checksums` in `sha256sum` format."""
    path = os.path.join(root, CHECKSUMS_FILE)
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist; write it in the checkpoint directory with "
                              f"`sha256sum *.safetensors > {CHECKSUMS_FILE}` (from a copy you trust)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e
    sums = {}
    for n, line in enumerate(lines, 1):
        if not line.strip() or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m is None:
            raise CheckpointError(f"{path}:{n}: expected `sha256sum` output ('<64 hex digits>  <file>'), "
                                  f"got {line[:120]!r}")
        sums[os.path.normpath(m.group(2))] = m.group(1).lower()
    return sums


def files_for_reader(files, readers: tuple[int, ...], rank: int) -> list[str]:
    """The weight files `rank` hashes: files spread over the readers in turn, each hashed exactly once."""
    if rank not in readers:
        return []
    return [f for i, f in enumerate(sorted(files)) if readers[i % len(readers)] == rank]


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    buf = bytearray(_HASH_BLOCK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


def listing_problems(root: str, files, readers: tuple[int, ...], rank: int) -> list[str]:
    """Before the transfer, on reader ranks: `root/checksums` can be read and lists each of this reader's
    share of `files` (nothing is hashed yet: HashingReader hashes while the transfer reads)."""
    mine = files_for_reader(files, readers, rank)
    if not mine:
        return []
    try:
        expected = read_checksums(root)
    except CheckpointError as e:
        return [str(e)]
    return [f"{f}: not listed in {CHECKSUMS_FILE} (add it: sha256sum {f} >> {CHECKSUMS_FILE})"
            for f in mine if os.path.normpath(f) not in expected]


def _mismatch(f: str, got: str, want: str) -> str:
    return (f"{f}: sha256 {got[:16]}..., but {CHECKSUMS_FILE} says {want[:16]}... (corrupt or replaced since the "
            "checksums were taken, or changed while it was loaded: re-download it)")


class HashingReader(ReaderWrapper):
    """Wraps a RangeReader: one running sha256 per file over the bytes as they are read (module docstring);
    finish() completes each file's hash and compares it with `root/checksums`."""

    def __init__(self, inner, root: str, files, readers: tuple[int, ...], rank: int):
        super().__init__(inner)
        self.root = root
        self.expected = read_checksums(root)
        self.whole = files_for_reader(files, readers, rank)  # hashed at the end if no read touched them
        self._files: dict[str, list] = {}   # file -> [next offset the hash needs, sha256, problem or None]
        self._lock = threading.Lock()
        self._scratch = bytearray(_HASH_BLOCK)

    def read_into(self, entry_file: str, offset: int, out, tally: bool = True) -> int:
        if is_legacy_file(entry_file):  # bytes from an unpickled file, not from the file: hashed whole
            return self.inner.read_into(entry_file, offset, out, tally=tally)
        with self._lock:  # the transfer reads on one thread; the lock keeps a file's hash in one order anyway
            state = self._files.setdefault(entry_file, [0, hashlib.sha256(), None])
            if offset < state[0] and state[2] is None:
                state[2] = (f"{entry_file}: bytes at offset {offset} were read again after the hash had passed "
                            "them; their checksum cannot be vouched for (read them in one pass)")
            self._hash_skipped(entry_file, state, offset)
            count = self.inner.read_into(entry_file, offset, out, tally=tally)
            if offset == state[0]:
                state[1].update(_flat_bytes(out)[:count])
                state[0] += count
            return count

    def prefetch(self, entry_file: str, offset: int, nbytes: int) -> None:
        self.inner.prefetch(entry_file, offset, nbytes)  # the same files as read_into's: pass the hint on

    def finish(self) -> list[str]:
        """Hash each file read to its end and compare; what is wrong, one line per file."""
        problems = []
        with self._lock:
            for f in sorted(set(self._files) | {w for w in self.whole if not is_legacy_file(w)}):
                state = self._files.setdefault(f, [0, hashlib.sha256(), None])
                try:
                    self._hash_skipped(f, state, os.path.getsize(os.path.join(self.root, f)))
                except (OSError, CheckpointError) as e:  # shrunk or gone since it was read: say which
                    problems.append(f"{f}: cannot finish its checksum: {e}")
                    continue
                want = self.expected.get(os.path.normpath(f))
                if state[2] is not None:
                    problems.append(state[2])
                elif want is None:
                    problems.append(f"{f}: not listed in {CHECKSUMS_FILE} (add it: sha256sum {f} >> {CHECKSUMS_FILE})")
                elif state[1].hexdigest() != want:
                    problems.append(_mismatch(f, state[1].hexdigest(), want))
        for f in (w for w in self.whole if is_legacy_file(w)):
            got, want = sha256_file(os.path.join(self.root, f)), self.expected.get(os.path.normpath(f))
            if got != want:
                problems.append(_mismatch(f, got, want or "(not listed)"))
        return problems

    def files_verified(self) -> int:
        return len(set(self._files) | set(self.whole))

    def _hash_skipped(self, f: str, state: list, upto: int) -> None:
        """Read and hash [state[0], upto): bytes this reader does not load (header, other readers' ranges)."""
        view = memoryview(self._scratch)
        while state[0] < upto:
            n = min(len(view), upto - state[0])
            self.inner.read_into(f, state[0], view[:n], tally=False)
            state[1].update(view[:n])
            state[0] += n


def hash_while_reading(reader, root: str, files, readers: tuple[int, ...], rank: int):
    """(reader to read through, its HashingReader): a reader of a virtual file (DCP) hashes the files under
    it, so the HashingReader goes around its inner RangeReader."""
    if isinstance(reader, ReaderWrapper):
        reader.inner = HashingReader(reader.inner, root, files, readers, rank)
        return reader, reader.inner
    hashing = HashingReader(reader, root, files, readers, rank)
    return hashing, hashing


def _flat_bytes(out) -> memoryview:
    if isinstance(out, torch.Tensor):
        return memoryview(out.reshape(-1).numpy())
    view = memoryview(out)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def checksum_verdict(by_rank: dict[int, list[str]], ranks: int, root: str) -> str | None:
    """One message for the readers' findings (by rank: the first few of the `ranks` that found any; identical on
    every rank), or None when all files match."""
    problems = sorted({p for found in by_rank.values() for p in found})
    if not problems:
        return None
    return f"--verify-checksums: {root}: " + "; ".join(problems) + _unnamed(ranks - len(by_rank))


def nonfinite(params: dict[str, torch.Tensor], specs: dict) -> list[tuple[str, int, int]]:
    """(param, NaN count, Inf count) for each of this rank's float params that holds any (aliases once)."""
    out = []
    for name in sorted(params):
        t = params[name]
        if specs.get(name) is not None and specs[name].alias_of:
            continue
        if not (t.is_floating_point() or t.is_complex()):
            continue
        flat = t.detach().reshape(-1)
        nan = inf = 0
        for start in range(0, flat.numel(), _SCAN_ELEMENTS):
            part = flat[start:start + _SCAN_ELEMENTS]
            if part.dtype.itemsize == 1:  # float8: few kernels take it; widen one slice at a time
                part = part.float()
            if bool(torch.isfinite(part).all()):
                continue
            nan += int(torch.isnan(part).sum())
            inf += int(torch.isinf(part).sum())
        if nan or inf:
            out.append((name, nan, inf))
    return out


def _unnamed(ranks: int) -> str:
    return f" (and what {ranks} more rank(s) found: each prints it)" if ranks > 0 else ""


def finite_verdict(by_rank: dict[int, list[tuple[str, int, int]]], ranks: int) -> str | None:
    """One message for the ranks' scans (by rank: the first few of the `ranks` that found any; identical
    everywhere), or None when every value is finite."""
    bad = [(r, name, nan, inf) for r, found in sorted(by_rank.items()) for name, nan, inf in found]
    if not bad:
        return None
    by_param: dict[str, list[int]] = {}
    for r, name, _, _ in bad:
        by_param.setdefault(name, []).append(r)
    detail = "; ".join(f"rank {r}: {name} ({nan} NaN, {inf} Inf)" for r, name, nan, inf in bad[:20])
    return (f"--check-finite: non-finite values in {names.describe(sorted(by_param))} ({detail}"
            f"{'; ...' if len(bad) > 20 else ''}){_unnamed(ranks - len(by_rank))}; the checkpoint holds NaN/Inf "
            "(a diverged or corrupt save)")
