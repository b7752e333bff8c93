"""Writing a sharded save (`--save-sharded OUT`), atomically.

Everything is written into a hidden sibling `.OUT.tmp-<token>`; each rank file is fsynced, the manifest is
written last (as `manifest.json.part`, fsynced, renamed), and only after every rank agreed does rank 0 swap
the directory into place (renameat2 RENAME_EXCHANGE where Linux offers it, so OUT is the old or the new
complete save at every instant; elsewhere the old save is renamed aside first). A directory holding rank
files but no manifest is an interrupted save and is refused as such (manifest.py); stale `.OUT.tmp-*`
directories of killed saves are removed by the next save at the same path. OUT is only ever replaced if
it is an earlier distload save (or empty).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import logging
import os
import shutil
import struct
import uuid
from pathlib import Path

import torch

from ..dtypes import TORCH_TO_SAFETENSORS
from ..errors import CheckpointError
from ..plan.reshard import rank_file
from ..transfer import broadcast_object
from ..transfer.collectives import count_over_ranks, gather_objects
from ..transfer.progress import size
from ..transfer.agreement import run_phase
from .manifest import DIGEST, FORMAT, FORMAT_VERSION, MANIFEST, byte_view, hidden, manifest_digest, siblings

log = logging.getLogger("distload")


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_rank_file(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> dict[str, dict]:
    """Write one safetensors file tensor by tensor, hashing the bytes on the way: no second copy of the
    shard in memory (safetensors' save_file builds one). Returns per tensor its absolute offset and sha256."""
    # Largest itemsize first, then by name (what safetensors does): every tensor is naturally aligned.
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header: dict = {"__metadata__": metadata}
    at = 0
    for name in order:
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": TORCH_TO_SAFETENSORS[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + nbytes]}
        at += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    data_start = 8 + len(blob)
    records = {}
    try:
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for name in order:
                view = byte_view(tensors[name])
                f.write(view)
                records[name] = {"offset": data_start + header[name]["data_offsets"][0],
                                 "sha256": hashlib.sha256(view).hexdigest()}
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        exc.filename = exc.filename or str(path)  # a failed write() names no file: the message must
        raise
    return records


def prepare_directory(out: Path, tmp: Path) -> None:
    if out.exists() and not (out / MANIFEST).is_file() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"--save-sharded {out}: the path exists and is not a distload save (no {MANIFEST}); "
                              f"refusing to replace it: choose another path, or remove it first")
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in siblings(out, "tmp"):  # left by a save that was killed: never complete, never read
        log.info("removing %s, left by an interrupted save", stale)
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir()


def save_sharded(out: str | os.PathLike, rank: int, params: dict[str, torch.Tensor], specs: dict, plan,
                 hf_config: dict, source: str, checkpoint_tensors: dict | None = None) -> Path:
    """Collective: every rank calls it with its own params; returns the final directory.

    `checkpoint_tensors` (name -> dtype, shape of the original checkpoint) defaults to the plan's sources;
    a reload passes the manifest's, since its plan reads rank files."""
    out = Path(out).absolute()
    world = plan.layout.world
    mine = {n: t for n, t in params.items() if not specs[n].alias_of}
    token = broadcast_object(uuid.uuid4().hex[:12] if rank == 0 else None, src=0)
    tmp = hidden(out, "tmp", token)
    # The save's size: each rank's own bytes, added up in one all-reduce (a rank's plan need not list other
    # blocks' params, and summing every rank's specs would cost rank 0 the whole job's).
    needed = count_over_ranks(sum(t.numel() * t.element_size() for t in mine.values()))

    def prepare() -> None:
        check_free_space(out, needed)
        prepare_directory(out, tmp)

    run_phase("save-sharded (prepare)", named_os_errors(out, prepare) if rank == 0 else lambda: None)

    def write() -> dict:
        written = _write_rank_file(tmp / rank_file(rank, world), mine,
                                   {"format": FORMAT, "rank": str(rank), "world_size": str(world)})
        return {n: {"local_shape": list(t.shape), **written[n],
                    **({"experts": list(specs[n].experts)} if specs[n].style == "expert" else {})}
                for n, t in mine.items()}

    def commit(records: list[dict]) -> None:
        tensors = checkpoint_tensors
        if tensors is None:   # every tensor some rank received, other blocks' too (a rank's plan lacks their sources)
            tensors = {e.name: {"dtype": e.dtype, "shape": list(e.shape)} for e in plan.received}
        part = tmp / f"{MANIFEST}.part"
        manifest = _manifest(plan, specs, records, hf_config, source, tensors)
        part.write_text(json.dumps({**manifest, DIGEST: manifest_digest(manifest)}, indent=1, sort_keys=True))
        _fsync_path(part)
        os.rename(part, tmp / MANIFEST)
        _fsync_path(tmp)
        _swap_into_place(tmp, out, token)

    try:
        # Only rank 0 writes the manifest: it alone receives the ranks' records.
        records = gather_objects(run_phase("save-sharded (write)", named_os_errors(out, write)))
        run_phase("save-sharded (commit)", named_os_errors(out, lambda: commit(records) if rank == 0 else None))
    finally:
        # Whatever failed, no half-written directory stays behind (after the swap, tmp holds the old save).
        if rank == 0 and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def check_free_space(out: Path, needed: int) -> None:
    """Refuse a save that cannot fit where it goes, before a byte of it is written."""
    existing = next(p for p in (out, *out.parents) if p.exists())
    free = shutil.disk_usage(existing).free
    if free < needed:
        # Each size in the unit that shows it (a small save in GiB read "0.00 GiB, ... has 0.00 GiB free").
        raise CheckpointError(f"--save-sharded {out}: the save needs {size(needed)}, {existing} has "
                              f"{size(free)} free; free space there or save elsewhere")


_OS_ERROR_FIX = {errno.ENOSPC: "the disk is full: free space there or save elsewhere",
                 errno.EDQUOT: "the disk quota is used up: free space or save elsewhere",
                 errno.EROFS: "the file system is read-only: save elsewhere",
                 errno.EFBIG: "the file is larger than this process may write (ulimit -f): raise the limit",
                 errno.EACCES: "no permission to write there: choose a writable place",
                 errno.EPERM: "no permission to write there: choose a writable place"}


def named_os_errors(out: Path, fn):
    """fn, with an OSError raised as the CheckpointError every rank prints (the file, the cause, the fix)."""
    def run():
        try:
            return fn()
        except OSError as exc:
            fix = _OS_ERROR_FIX.get(exc.errno, "fix the cause or save elsewhere")
            raise CheckpointError(f"--save-sharded {out}: writing {exc.filename or out} failed "
                                  f"({exc.strerror or exc}); {fix}; an earlier save at {out}, if any, is intact"
                                  ) from exc
    return run


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where the OS or file system can't."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not Linux, or glibc < 2.28
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _swap_into_place(tmp: Path, out: Path, token: str) -> None:
    """Make tmp the save at out; afterwards tmp holds the previous save (if any), for the caller to remove."""
    if not out.exists():
        os.rename(tmp, out)
    elif not _exchange(tmp, out):
        # rename() cannot replace a non-empty directory: move the old save aside, then put the new one in
        # place. Between the two renames OUT is missing, but the old save is intact at .OUT.old-<token>.
        old = hidden(out, "old", token)
        os.rename(out, old)
        try:
            os.rename(tmp, out)
        except BaseException:
            os.rename(old, out)
            raise
        os.rename(old, tmp)
    _fsync_path(out.parent)
    for stale in siblings(out, "old"):
        shutil.rmtree(stale, ignore_errors=True)


def stage_specs(plan, specs: dict) -> dict:
    """Every param some rank holds, by name: `specs` (this rank's) and, with pipeline stages, the first rank of
    each stage's (the others hold the same names as their stage's first rank)."""
    layout = plan.layout
    out = {}
    for r in range(0, layout.pp * layout.tp, layout.tp) if layout.pp > 1 else ():
        out.update(plan.specs[r])
    out.update(specs)
    return out


def _manifest(plan, specs: dict, records: list[dict], hf_config: dict, source: str, checkpoint_tensors: dict) -> dict:
    layout = plan.layout
    params = {}
    for name, spec in sorted(stage_specs(plan, specs).items()):
        entry = {"style": spec.style, "dtype": spec.dtype, "global_shape": list(spec.global_shape)}
        if spec.alias_of:
            entry["alias_of"] = spec.alias_of
        else:
            entry["ranks"] = [rec.get(name) for rec in records]   # None: that rank's stage lacks the param
        if layout.pp > 1:
            entry["pp_ranks"] = sorted(s for s in range(layout.pp) if name in plan.specs[s * layout.tp])
        params[name] = entry
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "world_size": layout.world,
        "tp": layout.tp,
        "ep": layout.ep,
        **stage_fields(layout),
        "expert_placement": layout.expert_placement,
        "config_name": plan.family,
        "source_checkpoint": source,
        "hf_config": hf_config,
        "checkpoint_tensors": checkpoint_tensors,
        "files": [rank_file(r, layout.world) for r in range(layout.world)],
        "params": params,
    }



def stage_fields(layout) -> dict:
    """The manifest's pipeline fields: pp, the layers per stage, and per rank its stage and layer range."""
    if not layout.pp_layers:
        return {"pp": layout.pp}
    return {"pp": layout.pp, "pp_layers": list(layout.pp_layers),
            "rank_stages": [layout.stage_record(r) for r in range(layout.world)]}
