"""Training-to-serving handoff: sharded saves and their reload (DESIGN §4.3).

`--save-sharded OUT` writes OUT/rank-{r:05d}-of-{W:05d}.safetensors (each rank its own params, serving
names) and OUT/manifest.json: format and version, world, tp, ep, expert placement, rules family, source
checkpoint, config.json, the original checkpoint's tensor names/shapes/dtypes (what --reshard replans),
and per param its style, dtype, global shape and per rank its local shape, byte offset in the rank file,
sha256 and hosted experts.

Atomic: everything is written into a hidden sibling `.OUT.tmp-<token>`; each rank file is fsynced, the
manifest is written last (as `manifest.json.part`, fsynced, renamed), and only after every rank agreed does
rank 0 swap the directory into place (renameat2 RENAME_EXCHANGE where Linux offers it, so OUT is the old
or the new complete save at every instant; elsewhere the old save is renamed aside first). A directory
holding rank files but no manifest is an interrupted save and is refused as such; stale `.OUT.tmp-*`
directories of killed saves are removed by the next save at the same path. OUT is only ever replaced if
it is an earlier distload save (or empty).

`distload load OUT` (loader.run_load branches here when OUT holds a manifest): on the saved topology each
rank reads only its own rank file, checked against the manifest (header: names, dtypes, shapes, offsets;
bytes: sha256 while reading, on by default: one SHA-256 pass over the bytes a reader reads, ~1.5 GiB/s per
core, on the read-ahead thread). Another topology is refused, naming both, before any weight byte is read;
with `reshard=True` the saved shards are re-cut for this job (see reshard.py). Either way the bytes move
through the ordinary transfer engine and are reconciled like any load.
"""

from __future__ import annotations

import bisect
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

from .dtypes import SAFETENSORS_TO_TORCH, TORCH_TO_SAFETENSORS
from .checkpoint import ReaderWrapper
from .errors import CheckpointError, PlanError
from .plan.reshard import describe_topology, rank_file, same_topology_plan, reshard_plan, saved_layout
from .transfer import agree, all_gather_objects, broadcast_object, computed_on_rank0

log = logging.getLogger("distload")

FORMAT = "distload-sharded"
FORMAT_VERSION = 2          # 2: per-rank byte offsets and the original checkpoint's tensors (for --reshard)
MANIFEST = "manifest.json"

__all__ = ["FORMAT", "FORMAT_VERSION", "MANIFEST", "checksum", "is_sharded_save", "load_sharded", "rank_file",
           "read_manifest", "save_sharded"]


def checksum(t: torch.Tensor) -> str:
    """sha256 of a tensor's raw bytes (any dtype, fp8 included)."""
    return hashlib.sha256(_byte_view(t)).hexdigest()


def _byte_view(t: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (a CPU copy of a device tensor)."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.cpu().numpy())


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------------------------------
# Save


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
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in order:
            view = _byte_view(tensors[name])
            f.write(view)
            records[name] = {"offset": data_start + header[name]["data_offsets"][0],
                             "sha256": hashlib.sha256(view).hexdigest()}
        f.flush()
        os.fsync(f.fileno())
    return records


def _hidden(out: Path, kind: str, token: str = "") -> Path:
    return out.parent / f".{out.name}.{kind}-{token}"


def _siblings(out: Path, kind: str) -> list[Path]:
    prefix = f".{out.name}.{kind}-"
    try:
        return sorted(p for p in out.parent.iterdir() if p.name.startswith(prefix))
    except FileNotFoundError:
        return []


def _prepare(out: Path, tmp: Path) -> None:
    if out.exists() and not (out / MANIFEST).is_file() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"--save-sharded {out}: the path exists and is not a distload save (no {MANIFEST}); "
                              f"refusing to replace it: choose another path, or remove it first")
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in _siblings(out, "tmp"):  # left by a save that was killed: never complete, never read
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
    token = broadcast_object(uuid.uuid4().hex[:12] if rank == 0 else None, src=0)
    tmp = _hidden(out, "tmp", token)
    error = None
    try:
        if rank == 0:
            _prepare(out, tmp)
    except BaseException as exc:
        error = exc
    agree("save-sharded (prepare)", error)
    try:
        record, error = None, None
        try:
            mine = {n: t for n, t in params.items() if not specs[n].alias_of}
            written = _write_rank_file(tmp / rank_file(rank, world), mine,
                                       {"format": FORMAT, "rank": str(rank), "world_size": str(world)})
            record = {n: {"local_shape": list(t.shape), **written[n],
                          **({"experts": list(specs[n].experts)} if specs[n].style == "expert" else {})}
                      for n, t in mine.items()}
        except BaseException as exc:
            error = exc
        agree("save-sharded (write)", error)
        records = all_gather_objects(record)
        error = None
        try:
            if rank == 0:
                if checkpoint_tensors is None:
                    checkpoint_tensors = {s.name: {"dtype": s.dtype, "shape": list(s.shape)}
                                          for s in plan.sources.values()}
                manifest = _manifest(plan, specs, records, hf_config, source, checkpoint_tensors)
                part = tmp / f"{MANIFEST}.part"
                part.write_text(json.dumps(manifest, indent=1, sort_keys=True))
                _fsync_path(part)
                os.rename(part, tmp / MANIFEST)
                _fsync_path(tmp)
                _swap_into_place(tmp, out, token)
        except BaseException as exc:
            error = exc
        agree("save-sharded (commit)", error)
    finally:
        # Whatever failed, no half-written directory stays behind (after the swap, tmp holds the old save).
        if rank == 0 and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


_save = save_sharded  # load_sharded's keyword `save_sharded` (the CLI flag) shadows the function there

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
        old = _hidden(out, "old", token)
        os.rename(out, old)
        try:
            os.rename(tmp, out)
        except BaseException:
            os.rename(old, out)
            raise
        os.rename(old, tmp)
    _fsync_path(out.parent)
    for stale in _siblings(out, "old"):
        shutil.rmtree(stale, ignore_errors=True)


def _manifest(plan, specs: dict, records: list[dict], hf_config: dict, source: str, checkpoint_tensors: dict) -> dict:
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
        "checkpoint_tensors": checkpoint_tensors,
        "files": [rank_file(r, layout.world) for r in range(layout.world)],
        "params": params,
    }


# ----------------------------------------------------------------------------------------------------
# Reload


def is_sharded_save(path: str | os.PathLike) -> bool:
    """Does `path` hold a distload save (or the remains of one, which the reload then explains)?"""
    p = Path(path)
    if not p.exists():
        return bool(_siblings(p.absolute(), "old"))
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
        old = _siblings(root, "old")
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


class ChecksumReader(ReaderWrapper):
    """Wraps a reader: hashes every source as the transfer reads it and compares with the manifest.

    The transfer reads a source's chunks in order, on one thread, so one running sha256 per source suffices.
    """

    def __init__(self, inner, expected: dict[str, list[tuple[int, int, str, str]]]):
        super().__init__(inner)
        self._spans = {f: sorted(v) for f, v in expected.items()}     # file -> (offset, nbytes, sha256, param)
        self._starts = {f: [s[0] for s in v] for f, v in self._spans.items()}
        self._state: dict[tuple[str, int], list] = {}                   # (file, offset) -> [next offset, hasher]

    def read_into(self, file: str, offset: int, out) -> int:
        count = self.inner.read_into(file, offset, out)
        i = bisect.bisect_right(self._starts[file], offset) - 1
        start, nbytes = self._spans[file][i][:2]
        state = self._state.setdefault((file, start), [start, hashlib.sha256()])
        if state[0] != offset or offset + count > start + nbytes:
            state[0] = -1  # not one sequential pass: cannot vouch for it, verify() says so
        else:
            state[1].update(memoryview(out.numpy()) if isinstance(out, torch.Tensor) else out)
            state[0] += count
        return count

    def verify(self) -> int:
        """Raise CheckpointError for every source whose bytes did not hash to the manifest's; returns the count."""
        bad = []
        for file, spans in sorted(self._spans.items()):
            for start, nbytes, want, param in spans:
                done, hasher = self._state.get((file, start), [start, None])
                if done != start + nbytes:
                    bad.append(f"{file}: {param} was not read in one pass, checksum not verified")
                elif hasher.hexdigest() != want:
                    bad.append(f"{file}: {param}: sha256 of its bytes is {hasher.hexdigest()[:16]}..., "
                               f"the manifest says {want[:16]}...")
        if bad:
            raise CheckpointError("checksum mismatch: " + "; ".join(bad[:10]) + " (the file changed or is corrupt "
                                  "since it was saved; save again, or pass --no-checksums to load it anyway)")
        return sum(len(v) for v in self._spans.values())



def _check_headers(root: Path, plan, rank: int, manifest: dict) -> None:
    """Before any weight byte: the files this rank reads hold exactly what the manifest says, where it says."""
    from .checkpoint import parse_safetensors_header
    from .checkpoint.discover import resolve_inside

    mine: dict[str, list] = {}
    for b in plan.buckets:
        if b.reader == rank:
            for c in b.chunks:
                src = plan.sources[c.source]
                mine.setdefault(src.file, []).append(src)
    problems = []
    for file, sources in sorted(mine.items()):
        path = resolve_inside(str(root), file, source=f"{MANIFEST} file {file!r}")
        if not os.path.isfile(path):
            raise CheckpointError(f"{root}: {file} is missing; the save is incomplete, save again")
        header = parse_safetensors_header(path, display_name=file)
        saved_rank = _saved_rank(file)
        expected = {n for n, e in manifest["params"].items() if not e.get("alias_of")}
        extra = sorted(set(header) - expected)
        if extra:
            problems.append(f"{file} holds tensors the manifest does not list: {extra[:5]}")
        for src in {s.name: s for s in sources}.values():
            param = src.name.split("::", 1)[1]
            entry = header.get(param)
            rec = manifest["params"][param]["ranks"][saved_rank]
            if entry is None:
                problems.append(f"{file} lacks {param}")
            elif (entry.dtype, tuple(entry.shape), entry.offset) != (src.dtype, tuple(rec["local_shape"]), rec["offset"]):
                problems.append(f"{file}: {param} is {entry.dtype}{list(entry.shape)} at byte {entry.offset}, the "
                                f"manifest says {src.dtype}{rec['local_shape']} at byte {rec['offset']}")
    if problems:
        raise CheckpointError(f"{root}: rank files and {MANIFEST} disagree: " + "; ".join(problems[:10])
                              + " (files replaced or damaged since the save; save again)")


def _saved_rank(file: str) -> int:
    return int(file.split("-")[1])  # rank-{r:05d}-of-{W:05d}.safetensors


def _expected_checksums(plan, rank: int, manifest: dict) -> dict[str, list[tuple[int, int, str, str]]]:
    expected: dict[str, list] = {}
    seen = set()
    for b in plan.buckets:
        if b.reader != rank:
            continue
        for c in b.chunks:
            src = plan.sources[c.source]
            if src.name in seen:
                continue
            seen.add(src.name)
            param = src.name.split("::", 1)[1]
            rec = manifest["params"][param]["ranks"][_saved_rank(src.file)]
            expected.setdefault(src.file, []).append((src.offset, src.nbytes, rec["sha256"], param))
    return expected


def _job_matches_save(manifest: dict, layout) -> bool:
    saved = saved_layout(manifest)
    if (saved.world, saved.tp, saved.ep) != (layout.world, layout.tp, layout.ep):
        return False
    if saved.expert_map is None:
        return True
    from .plan import expert_hosts

    num_experts = next(e["global_shape"][0] for e in manifest["params"].values() if e["style"] == "expert")
    return tuple(expert_hosts(num_experts, layout)) == saved.expert_map


def _topology_refusal(path: str, manifest: dict, layout) -> PlanError:
    has_experts = any(e["style"] == "expert" for e in manifest["params"].values())
    saved = describe_topology(manifest["world_size"], manifest["tp"], manifest["ep"],
                              manifest.get("expert_placement") if has_experts else None)
    this = describe_topology(layout.world, layout.tp, layout.ep, layout.expert_placement if has_experts else None)
    return PlanError(f"{path}: saved with {saved}; this job has {this}: pass --reshard to re-cut the shards for "
                     f"this job, or run with {manifest['world_size']} ranks (torchrun --nproc-per-node "
                     f"{manifest['world_size']} ... --tp {manifest['tp']} --ep {manifest['ep']})")


def load_sharded(path: str, *, tp: int | None = None, ep: int = 1, reshard: bool = False, config: str | None = None,
                 strict: bool = True, device: str | None = None, backend: str | None = None, timeout_s: float = 600.0,
                 staging_mib: int | None = None, read_strategy: str | None = None, expert_placement: str = "linear",
                 expert_map=None, checksums: bool = True, save_sharded: str | None = None, report: str | None = None,
                 into: dict[str, torch.Tensor] | None = None, progress: bool = True):
    """Reload a save (called by loader.run_load); returns a LoadResult like any load. The files decide who
    reads them (their owner; see reshard.py), so there is no `readers` option."""
    from dataclasses import replace

    from . import topology as topo_mod
    from .checkpoint import RangeReader, choose_strategy
    from .loader import LoadResult, _check_into, _phase, allocate, hand_off, transfer_phase
    from .plan import DEFAULT_STAGING_BYTES
    from .reconcile import reconcile
    from .report import PhaseClock, build_report, rank_record

    clock = PhaseClock()
    topo = topo_mod.from_environment(tp=tp, ep=ep, device=device, backend=backend, timeout_s=timeout_s,
                                     expert_placement=expert_placement, expert_map=expert_map)
    topo_mod.init_process_group(topo)
    rank = topo.rank
    root = Path(path).absolute()
    clock.lap("topology")

    manifest = _phase("discover", lambda: computed_on_rank0(lambda: read_manifest(str(root))))
    layout = topo.layout
    if tp is None and manifest["world_size"] == layout.world:
        layout = replace(layout, tp=manifest["tp"])  # no --tp: the saved one, on the saved world size
    clock.lap("discover")
    staging = (staging_mib << 20) if staging_mib else DEFAULT_STAGING_BYTES

    resharded = False

    def make_plan():
        nonlocal resharded
        if _job_matches_save(manifest, layout):
            return same_topology_plan(manifest, layout, staging)
        resharded = True
        if not reshard:
            raise _topology_refusal(str(root), manifest, layout)
        from .rules import rules_for

        return reshard_plan(manifest, rules_for(manifest["hf_config"], config), layout, staging)

    plan = _phase("planning", make_plan)
    specs = plan.specs[rank]
    _phase("verify headers", lambda: _check_headers(root, plan, rank, manifest))
    clock.lap("plan")

    params = _phase("allocate", lambda: allocate(specs, topo.device) if into is None else _check_into(into, specs))
    clock.lap("allocate")

    verified = 0

    def open_reader():
        strategy = read_strategy or choose_strategy(str(root), plan.checkpoint_bytes, topo.device,
                                                    topo.layout.local_world)[0]
        reader = RangeReader(str(root), strategy=strategy)
        return ChecksumReader(reader, _expected_checksums(plan, rank, manifest)) if checksums else reader

    def count_verified(reader):
        nonlocal verified
        if isinstance(reader, ChecksumReader):
            verified = reader.verify()

    reader, transfer = transfer_phase(plan, topo, params, open_reader, progress, after_transfer=count_verified)
    clock.lap("transfer")

    record = {**rank_record(rank, transfer.stats, reader, topo.device), "checksums_verified": verified}
    verdict = _phase("reconcile", lambda: reconcile(plan, rank, params, transfer.stats.written, strict=strict,
                                                    report_record=record))
    clock.lap("reconcile")
    per_rank = verdict.rank_reports
    saved = describe_topology(manifest["world_size"], manifest["tp"], manifest["ep"])
    result_report = build_report(plan, per_rank, clock.as_dict(), verdict, source=str(root),
                                 extra={"saved_topology": saved, "resharded": resharded, "checksums": checksums})
    result = LoadResult(params=params, specs=specs, report=result_report, plan=plan, verdict=verdict,
                        config=manifest["hf_config"], rank=rank)

    def save():
        _save(save_sharded, rank, params, specs, plan, manifest["hf_config"],
              manifest.get("source_checkpoint", str(root)), manifest.get("checkpoint_tensors"))
    return hand_off(result, clock, save if save_sharded else None, save_sharded, report)
