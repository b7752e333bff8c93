"""Plans for reloading a sharded save (DESIGN §4.3): pure functions (manifest, layout) -> LoadPlan.

The saved rank files are presented to the transfer engine as a checkpoint whose tensors are the saved
shards: source `rank-00002-of-00004.safetensors::model.layers.0.mlp.down_proj.weight` is rank 2's shard as
saved, at the byte offset the manifest records. The plan that delivers them is an ordinary LoadPlan, so
transfer/ moves the bytes, reconcile.py checks them, and nothing here touches a file or a process group.

Same topology: each source goes whole to the rank that saved it, and that rank is its reader. Every rank
reads its own file only, and no byte crosses the wire (a bucket nobody else receives is never sent).

Reshard: where does an element of new rank q's param come from? Both layouts are images of the same
checkpoint tensors under the same rules. Planning the original checkpoint (its names, shapes and dtypes
are in the manifest; no file is needed) once for the saved layout and once for the new one gives, per
checkpoint tensor, rectangles that map its 2-D view into each old rank's shard and into each new rank's
param; qkv, merged, vocab and expert styles come out per logical part, because the planner cuts per part.
Composing the two maps rectangle by rectangle (both are translations) gives pieces old shard -> new param.
A region that several old ranks hold (replicated params, kv heads replicated when tp > kv heads,
data-parallel replicas) is taken from the new rank's own old file when it has one, else from the lowest
old rank that holds it. Old file k is read by new rank k (k mod the new world when the new world is
smaller), whole, so every byte the manifest checksums is read and can be verified.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..checkpoint.header import TensorEntry
from ..dtypes import itemsize
from ..errors import CheckpointError, PlanError
from ..topology import Layout
from .buckets import buckets_for, interleaved
from .build import build_plan
from .digest import inputs_digest
from .quantization import UNQUANTIZED
from .shard import Piece, view2d
from .types import Bucket, Delivery, LoadPlan, ParamSpec, Source, is_broadcast, shares_of


def rank_file(rank: int, world: int) -> str:
    return f"rank-{rank:05d}-of-{world:05d}.safetensors"


def source_name(file: str, param: str) -> str:
    return f"{file}::{param}"


def describe_topology(world: int, tp: int, ep: int, placement: str | None = None, pp: int = 1,
                      pp_layers=None) -> str:
    text = f"world {world}, tp {tp}" + (f", pp {pp}" if pp > 1 else "") + f", ep {ep}"
    if pp > 1 and pp_layers:
        text += f", layers per stage {','.join(map(str, pp_layers))}"
    return text + (f", expert placement {placement}" if placement else "")


def saved_stage(manifest: dict, rank: int) -> int:
    """The pipeline stage rank `rank` of the save belonged to."""
    return (rank // manifest["tp"]) % manifest.get("pp", 1)


def saved_specs(manifest: dict, rank: int) -> dict[str, ParamSpec]:
    """What rank `rank` of the saved job held, as ParamSpecs (padding is in the file: nothing left to zero)."""
    specs = {}
    params = manifest["params"]
    stage = saved_stage(manifest, rank)
    for name, entry in params.items():
        owner = entry.get("alias_of") or name
        rec = params[owner]["ranks"][rank]
        if rec is None or stage not in entry.get("pp_ranks", (stage,)):
            continue   # another pipeline stage's param
        specs[name] = ParamSpec(name, entry["style"], entry["dtype"], tuple(entry["global_shape"]),
                                tuple(rec["local_shape"]), (), entry.get("alias_of"), tuple(rec.get("experts", ())))
    return specs


def saved_layout(manifest: dict) -> Layout:
    """The saved job's layout; an explicit expert map when the save hosted experts (EPLB maps included)."""
    hosted: dict[int, tuple[int, ...]] = {}   # per rank, from the first expert param its stage holds
    for entry in manifest["params"].values():
        if entry["style"] == "expert" and not entry.get("alias_of"):
            for r, rec in enumerate(entry["ranks"]):
                if rec is not None:
                    hosted.setdefault(r, tuple(rec.get("experts", ())))
    world = manifest["world_size"]
    expert_map = tuple(hosted.get(r, ()) for r in range(world)) if hosted else None
    pp_layers = manifest.get("pp_layers")
    return Layout(world=world, tp=manifest["tp"], ep=manifest["ep"],
                  expert_placement=manifest.get("expert_placement", "linear"), expert_map=expert_map,
                  pp=manifest.get("pp", 1), pp_layers=tuple(pp_layers) if pp_layers else None)


def _bucketed(sources: list[Source], reader_of: dict[str, int], world: int, staging_bytes: int) -> tuple[Bucket, ...]:
    """Buckets per reader (file order), interleaved so that every reader has work in flight (as build_plan)."""
    readers = sorted(set(reader_of.values()))
    per_reader = {}
    for r in readers:
        mine = sorted((s for s in sources if reader_of[s.name] == r), key=lambda s: (s.file, s.offset))
        per_reader[r] = buckets_for(r, [(s, (0, s.rows)) for s in mine], world, staging_bytes)
    return interleaved(per_reader, readers, world)


def same_topology_plan(manifest: dict, layout: Layout, staging_bytes: int) -> LoadPlan:
    """Every rank reads its own file and keeps all of it: no byte crosses the wire."""
    world = layout.world
    specs = tuple(saved_specs(manifest, r) for r in range(world))
    sources, reader_of = [], {}
    for r in range(world):
        file = rank_file(r, world)
        for name, spec in sorted(specs[r].items()):
            if spec.alias_of:
                continue
            rec = manifest["params"][name]["ranks"][r]
            src = source_name(file, name)
            rows, cols = view2d(spec.local_shape)
            ds = shares_of((Delivery(r, name, Piece(src, (0, rows), (0, cols), 0, 0)),))
            sources.append(Source(src, file, rec["offset"], spec.dtype, spec.local_shape, ds,
                                  is_broadcast(ds, spec.local_shape, world)))
            reader_of[src] = r
    return _plan(manifest, layout, specs, sources, reader_of, staging_bytes)


def _plan(manifest, layout: Layout, specs, sources, reader_of, staging_bytes, rules=None) -> LoadPlan:
    buckets = _bucketed(sources, reader_of, layout.world, staging_bytes)
    readers = tuple(sorted(set(reader_of.values()))) or (0,)
    return LoadPlan(family=manifest["config_name"], layout=replace(layout, readers=readers, owner_reads=False), specs=specs,
                    sources={s.name: s for s in sources}, buckets=buckets,
                    checkpoint_bytes=sum(s.nbytes for s in sources),
                    digest=inputs_digest({}, manifest, rules, layout, staging_bytes=staging_bytes))


def _checkpoint_index(manifest: dict) -> dict[str, TensorEntry]:
    """The original checkpoint as metadata only: enough to plan it, never to read it."""
    out = {}
    for name, e in manifest["checkpoint_tensors"].items():
        shape = tuple(e["shape"])
        out[name] = TensorEntry(name, "", e["dtype"], shape, 0, math.prod(shape) * itemsize(e["dtype"]))
    return out


def _check_reproduces(old: LoadPlan, manifest: dict, rules) -> None:
    """Replaying the rules on the saved layout must give exactly what was saved, or the composition is wrong."""
    fix = ("reshard with the rules the save was made with (--config PATH), or reload it on its own topology "
           "without --reshard")
    if rules.name != manifest["config_name"]:
        raise PlanError(f"the save was made with rules family {manifest['config_name']!r}, this job chose "
                        f"{rules.name!r} ({rules.source}); {fix}")
    for r in range(old.layout.world):
        want = saved_specs(manifest, r)
        got = old.specs[r]
        if set(got) != set(want):
            raise PlanError(f"rules {rules.source} do not reproduce the saved params: they give "
                            f"{sorted(set(got) ^ set(want))[:5]} differently; {fix}")
        for name, w in want.items():
            g = got[name]
            mine = (g.style, g.dtype, tuple(g.global_shape), tuple(g.local_shape), g.alias_of, tuple(g.experts))
            saved = (w.style, w.dtype, tuple(w.global_shape), tuple(w.local_shape), w.alias_of, tuple(w.experts))
            if mine != saved:
                raise PlanError(f"{name} on saved rank {r}: saved (style, dtype, global shape, local shape, alias, "
                                f"experts) = {saved}, rules {rules.source} give {mine}; {fix}")


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def reshard_plan(manifest: dict, rules, layout: Layout, staging_bytes: int, quantization=UNQUANTIZED) -> LoadPlan:
    """Re-cut the saved shards for `layout` (see the module docstring). quantization: of the saved checkpoint's
    config.json (quant.for_load), which the original's plan is made with."""
    if "checkpoint_tensors" not in manifest:
        raise CheckpointError("the manifest does not list the original checkpoint tensors; re-save with this distload")
    index = _checkpoint_index(manifest)
    config = manifest["hf_config"]
    old = build_plan(index, config, rules, saved_layout(manifest), strict=False, quantization=quantization)
    rewrites = [step for steps in old.post for step in steps if not step.only_checks]
    if rewrites:
        kinds = sorted({step.op for step in rewrites})
        raise PlanError(f"--reshard: the save holds params made by post-load steps ({', '.join(kinds)}"
                        + (f"; {old.quantization}" if old.quantization else "") + "); re-cutting them is not "
                        "supported: reload it on its own topology, or load the original checkpoint")
    _check_reproduces(old, manifest, rules)
    new = build_plan(index, config, rules, layout, strict=False, quantization=quantization)
    old_world = manifest["world_size"]

    by_source: dict[tuple[int, str], list[Delivery]] = {}
    for ckpt_name, nsrc in new.sources.items():
        # Old holders of each rectangle of this checkpoint tensor, lowest rank first.
        holders: dict[tuple, list[Delivery]] = {}
        for d in sorted(old.sources[ckpt_name].deliveries, key=lambda d: d.rank):
            holders.setdefault((d.param, d.piece.rows, d.piece.cols), []).append(d)
        for dn in nsrc.deliveries:
            if dn.param not in manifest["params"]:
                continue   # a staged-only input of a value check (a fused part's g_idx): checked at the save's load
            area = 0
            for (param, rows, cols), ds in holders.items():
                rows_i, cols_i = _overlap(rows, dn.piece.rows), _overlap(cols, dn.piece.cols)
                if param != dn.param or rows_i is None or cols_i is None:
                    continue
                do = next((d for d in ds if d.rank == dn.rank), ds[0])
                # Both pieces translate checkpoint coordinates; compose them on the intersection.
                src_rows = (do.piece.dst_row + rows_i[0] - rows[0], do.piece.dst_row + rows_i[1] - rows[0])
                src_cols = (do.piece.dst_col + cols_i[0] - cols[0], do.piece.dst_col + cols_i[1] - cols[0])
                dst_row = dn.piece.dst_row + rows_i[0] - dn.piece.rows[0]
                dst_col = dn.piece.dst_col + cols_i[0] - dn.piece.cols[0]
                name = source_name(rank_file(do.rank, old_world), param)
                by_source.setdefault((do.rank, param), []).append(
                    Delivery(dn.rank, dn.param, Piece(name, src_rows, src_cols, dst_row, dst_col)))
                area += (rows_i[1] - rows_i[0]) * (cols_i[1] - cols_i[0])
            if area != dn.piece.numel:
                raise PlanError(f"{dn.param}: the saved shards cover {area} of the {dn.piece.numel} elements new rank "
                                f"{dn.rank} needs from {ckpt_name}; the manifest's layout is inconsistent (re-save)")

    sources, reader_of = [], {}
    for (old_rank, param), ds in sorted(by_source.items()):
        rec = manifest["params"][param]["ranks"][old_rank]
        file = rank_file(old_rank, old_world)
        shape = tuple(rec["local_shape"])
        shares = shares_of(ds)
        src = Source(source_name(file, param), file, rec["offset"], manifest["params"][param]["dtype"], shape,
                     shares, is_broadcast(shares, shape, layout.world))
        sources.append(src)
        reader_of[src.name] = old_rank % layout.world
    return _plan(manifest, new.layout, new.specs, sources, reader_of, staging_bytes, rules)  # with its stages
