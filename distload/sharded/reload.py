"""Reloading a sharded save (`distload load OUT`): the source of the pipeline for a directory with a
manifest (sources.py has the protocol).

On the saved topology each rank reads only its own rank file, checked against the manifest (header:
names, dtypes, shapes, offsets; bytes: sha256 while reading, on by default: one SHA-256 pass over the
bytes a reader reads, on the read-ahead thread). Another topology is refused, naming both, before any
weight byte is read; with `reshard=True` the saved shards are re-cut for this job (reshard.py). Either
way the bytes move through the ordinary transfer engine and are reconciled like any load. The files
decide who reads them (their owner), so the `readers` option does not apply.
"""

from __future__ import annotations

import bisect
import hashlib
import os
from dataclasses import replace
from pathlib import Path

import torch

from ..checkpoint import RangeReader, ReaderWrapper, parse_safetensors_header
from ..checkpoint.discover import resolve_inside
from ..checkpoint.header import header_metadata
from ..errors import CheckpointError, PlanError
from ..plan import DEFAULT_STAGING_BYTES, expert_hosts
from ..plan.reshard import describe_topology, reshard_plan, same_topology_plan, saved_layout
from ..quant import for_load
from ..rules import rules_for
from ..sources import Origin
from ..transfer.agreement import run_phase
from .manifest import FORMAT, MANIFEST, read_manifest, saved_rank


class ShardedSource:
    """A distload save: each rank's own rank file (or, --reshard, the pieces this job needs of them)."""

    def __init__(self, path: str, options):
        self.root, self.options = Path(path).absolute(), options
        self.checksums = options.checksums or options.verify_checksums  # the manifest's sha256, while reading
        self.resharded = False

    def discover(self) -> dict:
        return read_manifest(str(self.root))

    def early_fetch(self, found, layout):
        return None

    def origin(self, found) -> Origin:
        return Origin(str(self.root), found["hf_config"], 0, found.get("source_checkpoint", str(self.root)),
                      found.get("checkpoint_tensors"))

    def plan(self, manifest: dict, layout, rank: int | None = None):   # the whole job's plan (reshard.py)
        if self.options.tp is None and manifest["world_size"] == layout.world:
            # no --tp: the saved layout (tp, pipeline stages), on the saved world size
            pp_layers = manifest.get("pp_layers") if manifest.get("pp", 1) > 1 else None
            layout = replace(layout, tp=manifest["tp"], pp=manifest.get("pp", 1),
                             pp_layers=tuple(pp_layers) if pp_layers else None)
        staging = self.options.staging_bytes or DEFAULT_STAGING_BYTES
        if job_matches_save(manifest, layout):
            saved_parts = manifest.get("pp_layers")
            saved_stages = dict(pp_layers=tuple(saved_parts), pp_layers_from=MANIFEST) if saved_parts else {}
            return same_topology_plan(manifest, replace(layout, **saved_stages), staging)
        self.resharded = True
        if not self.options.reshard:
            raise topology_refusal(str(self.root), manifest, layout)
        return reshard_plan(manifest, rules_for(manifest["hf_config"], self.options.config), layout, staging,
                            for_load(manifest["hf_config"]))

    def before_transfer(self, manifest: dict, plan, rank: int, clock) -> dict:
        run_phase("verify headers", lambda: check_headers(self.root, plan, rank, manifest))
        self._expected = expected_checksums(plan, rank, manifest) if self.checksums else None
        return {"checksums_verified": 0}

    def copy_blocker(self, found, plan) -> str | None:
        return "a sharded save: each rank reads its own rank file" + (", checking its sha256" if self.checksums
                                                                       else "")

    def open_reader(self, found, plan, rank: int, strategy: str, exact: bool):
        reader = RangeReader(str(self.root), strategy=strategy)
        return ChecksumReader(reader, self._expected) if self._expected is not None else reader

    def after_transfer(self, reader) -> dict:
        return {"checksums_verified": reader.verify()} if isinstance(reader, ChecksumReader) else {}

    def after_landing(self, found, plan, rank: int, clock) -> dict:
        return {}  # checked inside the transfer (after_transfer): each rank its own files

    def report_extra(self, manifest: dict, plan, per_rank=()) -> dict:
        saved = describe_topology(manifest["world_size"], manifest["tp"], manifest["ep"], None,
                                  manifest.get("pp", 1), manifest.get("pp_layers"))
        return {"saved_topology": saved, "resharded": self.resharded, "checksums": self.checksums}


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



def check_headers(root: Path, plan, rank: int, manifest: dict) -> None:
    """Before any weight byte: the files this rank reads hold exactly what the manifest says, where it says."""
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
        owner = saved_rank(file)
        problems += _renamed(file, header_metadata(path, display_name=file), owner, manifest["world_size"])
        expected = {n for n, e in manifest["params"].items() if not e.get("alias_of")}
        extra = sorted(set(header) - expected)
        if extra:
            problems.append(f"{file} holds tensors the manifest does not list: {extra[:5]}")
        for src in {s.name: s for s in sources}.values():
            param = src.name.split("::", 1)[1]
            entry = header.get(param)
            rec = manifest["params"][param]["ranks"][owner]
            if entry is None:
                problems.append(f"{file} lacks {param}")
            elif (entry.dtype, tuple(entry.shape), entry.offset) != (src.dtype, tuple(rec["local_shape"]), rec["offset"]):
                problems.append(f"{file}: {param} is {entry.dtype}{list(entry.shape)} at byte {entry.offset}, the "
                                f"manifest says {src.dtype}{rec['local_shape']} at byte {rec['offset']}")
    if problems:
        raise CheckpointError(f"{root}: rank files and {MANIFEST} disagree: " + "; ".join(problems[:10])
                              + " (files replaced or damaged since the save; save again)")


def _renamed(file: str, metadata: dict, owner: int, world: int) -> list[str]:
    """A rank file says in its header whose it is (save.py writes rank and world_size): files swapped or copied
    from another save of the same shapes are caught here, before a byte is read, --no-checksums or not."""
    if metadata.get("format") != FORMAT:
        return []
    said = (metadata.get("rank"), metadata.get("world_size"))
    if said == (str(owner), str(world)):
        return []
    return [f"{file} says it is rank {said[0]}'s file of a save of {said[1]} ranks (its __metadata__), not rank "
            f"{owner}'s of {world}: rank files renamed or swapped"]


def expected_checksums(plan, rank: int, manifest: dict) -> dict[str, list[tuple[int, int, str, str]]]:
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
            rec = manifest["params"][param]["ranks"][saved_rank(src.file)]
            expected.setdefault(src.file, []).append((src.offset, src.nbytes, rec["sha256"], param))
    return expected


def stage_partition(layout, manifest: dict):
    """The job's layers per stage for the save's model (None: the save does not say how many layers)."""
    saved = manifest.get("pp_layers")
    return layout.stage_partition(sum(saved)) if saved else None


def job_matches_save(manifest: dict, layout) -> bool:
    saved = saved_layout(manifest)
    if (saved.world, saved.tp, saved.ep, saved.pp) != (layout.world, layout.tp, layout.ep, layout.pp):
        return False
    if saved.pp > 1 and stage_partition(layout, manifest) != saved.pp_layers:
        return False
    if saved.expert_map is None:
        return True
    num_experts = next(e["global_shape"][0] for e in manifest["params"].values() if e["style"] == "expert")
    return tuple(expert_hosts(num_experts, layout)) == saved.expert_map


def topology_refusal(path: str, manifest: dict, layout) -> PlanError:
    has_experts = any(e["style"] == "expert" for e in manifest["params"].values())
    pp = manifest.get("pp", 1)
    saved = describe_topology(manifest["world_size"], manifest["tp"], manifest["ep"],
                              manifest.get("expert_placement") if has_experts else None, pp, manifest.get("pp_layers"))
    this = describe_topology(layout.world, layout.tp, layout.ep, layout.expert_placement if has_experts else None,
                             layout.pp, stage_partition(layout, manifest) if layout.pp > 1 else None)
    stages = f" --pp {pp} --pp-layers {','.join(map(str, manifest['pp_layers']))}" if pp > 1 else ""
    return PlanError(f"{path}: saved with {saved}; this job has {this}: pass --reshard to re-cut the shards for "
                     f"this job, or run with {manifest['world_size']} ranks (torchrun --nproc-per-node "
                     f"{manifest['world_size']} ... --tp {manifest['tp']}{stages} --ep {manifest['ep']})")
