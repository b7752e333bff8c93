"""Training-to-serving handoff: sharded saves (DESIGN §4.3).

`--save-sharded OUT` writes OUT/rank-{r:05d}-of-{W:05d}.safetensors (each rank its own params, serving
names) and OUT/manifest.json. Everything is written into a temporary sibling directory, fsynced, and
renamed into place only after every rank has finished: an interrupted save never leaves a directory that
looks complete, and never damages an earlier save at the same path.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

import torch

from .transfer import agree, all_gather_objects, barrier, broadcast_object

FORMAT = "distload-sharded"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


def rank_file(rank: int, world: int) -> str:
    return f"rank-{rank:05d}-of-{world:05d}.safetensors"


def checksum(t: torch.Tensor) -> str:
    """sha256 of a tensor's raw bytes (any dtype, fp8 included)."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_sharded(out: str | os.PathLike, rank: int, params: dict[str, torch.Tensor], specs: dict, plan,
                 hf_config: dict, source: str) -> Path:
    """Collective: every rank calls it with its own params; returns the final directory."""
    from safetensors.torch import save_file

    out = Path(out).absolute()
    world = plan.layout.world
    token = broadcast_object(uuid.uuid4().hex[:12] if rank == 0 else None, src=0)
    tmp = out.parent / f".{out.name}.tmp-{token}"
    error = None
    try:
        if rank == 0:
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
    except BaseException as exc:
        error = exc
    agree("save-sharded (prepare)", error)
    record, error = None, None
    try:
        mine = {n: t.detach().contiguous().cpu() for n, t in params.items() if not specs[n].alias_of}
        path = tmp / rank_file(rank, world)
        save_file(mine, str(path), metadata={"format": FORMAT, "rank": str(rank), "world_size": str(world)})
        _fsync_path(path)
        record = {n: {"local_shape": list(t.shape), "sha256": checksum(t),
                      **({"experts": list(specs[n].experts)} if specs[n].experts else {})}
                  for n, t in mine.items()}
    except BaseException as exc:
        error = exc
    agree("save-sharded (write)", error)
    records = all_gather_objects(record)
    error = None
    try:
        if rank == 0:
            manifest = _manifest(plan, specs, records, hf_config, source)
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
            _fsync_path(tmp / MANIFEST)
            _fsync_path(tmp)
            _swap_into_place(tmp, out, token)
    except BaseException as exc:
        error = exc
    try:
        agree("save-sharded (commit)", error)
    finally:
        if rank == 0 and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    barrier()
    return out


def _swap_into_place(tmp: Path, out: Path, token: str) -> None:
    # rename() cannot replace a non-empty directory: move the old save aside first, then remove it only
    # once the new one is in place, so at every instant OUT is either the old or the new complete save.
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{token}"
        os.rename(out, old)
    os.rename(tmp, out)
    _fsync_path(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _manifest(plan, specs: dict, records: list[dict], hf_config: dict, source: str) -> dict:
    layout = plan.layout
    params = {}
    for name, spec in sorted(specs.items()):
        entry = {"style": spec.style, "dtype": spec.dtype, "global_shape": list(spec.global_shape)}
        if spec.alias_of:
            entry["alias_of"] = spec.alias_of
        else:
            entry["ranks"] = [rec[name] for rec in records]
        params[name] = entry
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "world_size": layout.world,
        "tp": layout.tp,
        "ep": layout.ep,
        "expert_placement": layout.expert_placement,
        "config_name": plan.family,
        "source_checkpoint": source,
        "hf_config": hf_config,
        "files": [rank_file(r, layout.world) for r in range(layout.world)],
        "params": params,
    }
