"""Opt-in integrity checks: `--verify-checksums` (files against a `checksums` list) and `--check-finite`.

A truncated or bit-flipped file whose header still parses loads as a silently wrong model, and a
checkpoint saved after a diverged step holds NaN. Both checks cost a full pass over bytes, so they are
opt-in: sha256 of each weight file on reader ranks before the transfer (each file hashed by one reader),
and a NaN/Inf scan of each rank's own params after it.
"""

from __future__ import annotations

import hashlib
import os
import re

import torch

from . import names
from .errors import CheckpointError

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


def checksum_problems(root: str, files, readers: tuple[int, ...], rank: int) -> list[str]:
    """Hash this reader's share of `files` against `root/checksums`; what is wrong, one line per file."""
    mine = files_for_reader(files, readers, rank)
    if not mine:
        return []
    try:
        expected = read_checksums(root)
    except CheckpointError as e:
        return [str(e)]
    problems = []
    for f in mine:
        want = expected.get(os.path.normpath(f))
        if want is None:
            problems.append(f"{f}: not listed in {CHECKSUMS_FILE} (add it: sha256sum {f} >> {CHECKSUMS_FILE})")
            continue
        got = sha256_file(os.path.join(root, f))
        if got != want:
            problems.append(f"{f}: sha256 {got[:16]}..., but {CHECKSUMS_FILE} says {want[:16]}... (corrupt or "
                            "replaced since the checksums were taken: re-download it)")
    return problems


def checksum_verdict(per_rank: list[list[str]], root: str) -> str | None:
    """One message for every reader's findings (identical on every rank), or None when all files match."""
    problems = sorted({p for found in per_rank for p in found})
    if not problems:
        return None
    return f"--verify-checksums: {root}: " + "; ".join(problems)


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


def finite_verdict(per_rank: list[list[tuple[str, int, int]]]) -> str | None:
    """One message for every rank's scan (identical everywhere), or None when every value is finite."""
    bad = [(r, name, nan, inf) for r, found in enumerate(per_rank) for name, nan, inf in found]
    if not bad:
        return None
    by_param: dict[str, list[int]] = {}
    for r, name, _, _ in bad:
        by_param.setdefault(name, []).append(r)
    detail = "; ".join(f"rank {r}: {name} ({nan} NaN, {inf} Inf)" for r, name, nan, inf in bad[:20])
    return (f"--check-finite: non-finite values in {names.describe(sorted(by_param))} ({detail}"
            f"{'; ...' if len(bad) > 20 else ''}); the checkpoint holds NaN/Inf (a diverged or corrupt save)")
