"""distload's sharded saves on disk: the format, its manifest, and telling a save (or the remains of an
interrupted one) when a load meets it (DESIGN §4.3).

A save is OUT/rank-{r:05d}-of-{W:05d}.safetensors (each rank its own params, serving names) and
OUT/manifest.json: format and version, world, tp, ep, expert placement, rules family, source checkpoint,
config.json, the original checkpoint's tensor names/shapes/dtypes (what --reshard replans), and per param
its style, dtype, global shape and per rank its local shape, byte offset in the rank file, sha256 and
hosted experts. save.py writes it, reload.py reads it back.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from ..dtypes import SAFETENSORS_TO_TORCH
from ..errors import CheckpointError
from ..plan.reshard import rank_file

FORMAT = "distload-sharded"
FORMAT_VERSION = 2          # 2: per-rank byte offsets and the original checkpoint's tensors (for --reshard)
MANIFEST = "manifest.json"


def checksum(t: torch.Tensor) -> str:
    """sha256 of a tensor's raw bytes (any dtype, fp8 included)."""
    return hashlib.sha256(byte_view(t)).hexdigest()


def byte_view(t: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (a CPU copy of a device tensor)."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.cpu().numpy())


def hidden(out: Path, kind: str, token: str = "") -> Path:
    """The hidden sibling of a save where a save is written (tmp) or the previous one set aside (old)."""
    return out.parent / f".{out.name}.{kind}-{token}"


def siblings(out: Path, kind: str) -> list[Path]:
    prefix = f".{out.name}.{kind}-"
    try:
        return sorted(p for p in out.parent.iterdir() if p.name.startswith(prefix))
    except FileNotFoundError:
        return []


def saved_rank(file: str) -> int:
    return int(file.split("-")[1])  # rank-{r:05d}-of-{W:05d}.safetensors


def is_sharded_save(path: str | os.PathLike) -> bool:
    """Does `path` hold a distload save (or the remains of one, which the reload then explains)?"""
    p = Path(path)
    if not p.exists():
        return bool(siblings(p.absolute(), "old"))
    if not p.is_dir():
        return False
    if (p / MANIFEST).is_file():
        return True
    return any(e.name.startswith("rank-") and "-of-" in e.name and e.name.endswith(".safetensors")
               for e in os.scandir(p))


def read_manifest(path: str | os.PathLike) -> dict:
    """The manifest of a save at `path`, validated; CheckpointError naming the problem and the fix otherwise."""
    root = Path(path).absolute()
    if not root.exists():
        old = siblings(root, "old")
        raise CheckpointError(f"{root} does not exist, but {old[0]} does: a save was interrupted while swapping "
                              f"directories; that is the previous complete save: rename it to {root}")
    mpath = root / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"{root}: holds distload rank files but no {MANIFEST}: the save that wrote them was "
                              f"interrupted (the manifest is written last); save again")
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{mpath}: cannot read the manifest ({exc}); save again") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{mpath}: not a {FORMAT} manifest")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        hint = "save it again with this distload" if isinstance(version, int) and version < FORMAT_VERSION \
            else "upgrade distload to read it"
        raise CheckpointError(f"{mpath}: format_version {version!r}, this distload reads {FORMAT_VERSION}; {hint}")
    for key in ("world_size", "tp", "ep", "params", "files", "hf_config", "config_name"):
        if key not in manifest:
            raise CheckpointError(f"{mpath}: missing key {key!r}; the manifest is damaged, save again")
    world = manifest["world_size"]
    if manifest["files"] != [rank_file(r, world) for r in range(world)]:
        raise CheckpointError(f"{mpath}: 'files' does not list rank-00000..{world - 1:05d}-of-{world:05d}; damaged")
    for name, entry in manifest["params"].items():
        owner = entry.get("alias_of") or name
        ranks = manifest["params"].get(owner, {}).get("ranks")
        if entry.get("dtype") not in SAFETENSORS_TO_TORCH or not isinstance(ranks, list) or len(ranks) != world:
            raise CheckpointError(f"{mpath}: param {name!r}: expected a known dtype and one record per rank "
                                  f"({world}); the manifest is damaged, save again")
    return manifest

