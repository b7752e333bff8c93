"""Checks of loads from object storage against the test S3 server's request log (s3_server.py): each byte range
of each weight file fetched once per job, headers included; bit-for-bit comparison of params (FP8 as bytes)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def weight_files(directory) -> list[str]:
    """The weight files a load of `directory` reads: the index's, else every .safetensors file."""
    index = Path(directory) / "model.safetensors.index.json"
    if index.exists():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return sorted(p.name for p in Path(directory).glob("*.safetensors"))


def header_bytes(directory) -> int:
    """8 + the header of every weight file: what discovery fetches of them."""
    total = 0
    for name in weight_files(directory):
        with open(Path(directory) / name, "rb") as f:
            total += 8 + int.from_bytes(f.read(8), "little")
    return total


def fetch_problems(log, prefix: str, directory, tensors_only: bool = False) -> list[str]:
    """Every weight file of `directory` (uploaded under `prefix`): the ranged GETs the server answered whole cover
    each of its bytes exactly once (tensors_only: each byte after the header); empty when so."""
    problems = []
    for name in weight_files(directory):
        path = Path(directory) / name
        size = path.stat().st_size
        with open(path, "rb") as f:
            data_start = 8 + int.from_bytes(f.read(8), "little") if tensors_only else 0
        spans = sorted(e.span for e in log.ranged(f"^{prefix}/{name}$") if e.span[0] >= data_start)
        cursor = data_start
        for a, b in spans:
            if a != cursor:
                problems.append(f"{prefix}/{name}: bytes {min(a, cursor)}-{max(a, cursor)} "
                                f"{'fetched twice' if a < cursor else 'never fetched'}")
            cursor = max(cursor, b)
        if cursor != size:
            problems.append(f"{prefix}/{name}: fetched up to byte {cursor} of {size}")
    return problems


def bitwise(got: dict, want: dict, where: str) -> list[str]:
    """Names and tensors that differ in any bit (FP8 and all: compared as bytes)."""
    if sorted(got) != sorted(want):
        return [f"{where}: names differ: {sorted(set(got) ^ set(want))}"]
    return [f"{where}: {n} differs" for n in sorted(got)
            if got[n].dtype != want[n].dtype or got[n].shape != want[n].shape
            or not torch.equal(got[n].reshape(-1).view(torch.uint8), want[n].reshape(-1).view(torch.uint8))]
