"""distload's sharded saves on disk: the format, its manifest, and telling a save (or the remains of an
interrupted one) when a load meets it (DESIGN §4.3).

A save is OUT/rank-{r:05d}-of-{W:05d}.safetensors (each rank its own params, serving names) and
OUT/manifest.json: format and version, world, tp, ep, pp (with the layers per stage and each rank's stage and
layer range), expert placement, rules family, source checkpoint,
config.json, the original checkpoint's tensor names/shapes/dtypes (what --reshard replans), and per param
its style, dtype, global shape and per rank its local shape, byte offset in the rank file, sha256 and
hosted experts (null on the ranks of stages that lack the param). save.py writes it, reload.py reads it back.
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
from ..rules import STYLES
from ..topology import PLACEMENTS

FORMAT = "distload-sharded"
FORMAT_VERSION = 3          # 2: per-rank byte offsets and the original checkpoint's tensors (for --reshard);
                            # 3: the manifest's own sha256 (an edited manifest is refused)
MANIFEST = "manifest.json"


DIGEST = "manifest_sha256"


def manifest_digest(manifest: dict) -> str:
    """sha256 of the manifest without its own digest, as canonical JSON (key order and spacing fixed)."""
    body = {k: v for k, v in manifest.items() if k != DIGEST}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


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
    check_manifest(manifest, mpath)
    digest = manifest.get(DIGEST)
    if digest != manifest_digest(manifest):
        found = f"records {digest!r}" if DIGEST in manifest else "has none"
        raise CheckpointError(f"{mpath}: {DIGEST}: the manifest's own checksum is {manifest_digest(manifest)[:16]}..., "
                              f"the manifest {found}: it was edited or damaged since the save (its fields no longer "
                              f"vouch for the rank files); save again")
    return manifest


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_shape(value) -> bool:
    return isinstance(value, list) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value)


COUNT, SHAPE = "a whole number >= 1", "a list of whole numbers >= 0"
TOP_FIELDS = {  # key: (required, test, what it must be)
    "world_size": (True, _is_count, COUNT),
    "tp": (True, _is_count, COUNT),
    "ep": (True, _is_count, COUNT),
    "config_name": (True, lambda v: isinstance(v, str) and v != "", "the rules family's name"),
    "hf_config": (True, lambda v: isinstance(v, dict), "the model's config.json, an object"),
    "files": (True, lambda v: isinstance(v, list), "the list of rank files"),
    "params": (True, lambda v: isinstance(v, dict) and v != {}, "an object: param name -> its record"),
    "pp": (False, _is_count, COUNT),
    "pp_layers": (False, lambda v: isinstance(v, list) and v != [] and all(_is_count(n) for n in v),
                  "the layers per pipeline stage, whole numbers >= 1"),
    "rank_stages": (False, lambda v: isinstance(v, list), "per rank its pipeline stage and layer range"),
    "expert_placement": (False, lambda v: v in PLACEMENTS, f"one of {', '.join(PLACEMENTS)}"),
    "source_checkpoint": (False, lambda v: isinstance(v, str), "the source checkpoint's path"),
    "checkpoint_tensors": (False, lambda v: v is None or isinstance(v, dict), "an object: tensor name -> record"),
}


class _Damage:
    """Raises naming the manifest's field, what it must be and what it holds."""

    def __init__(self, mpath: Path):
        self.mpath = mpath

    def __call__(self, field: str, want: str, got=None, missing: bool = False) -> CheckpointError:
        found = "missing" if missing else f"got {json.dumps(got)[:80]}"
        return CheckpointError(f"{self.mpath}: {field}: expected {want}, {found}; the manifest is damaged, "
                               "save again")

    def expect(self, ok: bool, field: str, want: str, got) -> None:
        if not ok:
            raise self(field, want, got)


def check_manifest(manifest: dict, mpath: Path) -> None:
    """Every field typed and checked (what the reload and --reshard use), the error naming the field."""
    damage = _Damage(mpath)
    for key, (required, test, want) in TOP_FIELDS.items():
        if key not in manifest:
            if required:
                raise damage(key, want, missing=True)
            continue
        damage.expect(test(manifest[key]), key, want, manifest[key])
    world, pp = manifest["world_size"], manifest.get("pp", 1)
    per_stage = f" / pp {pp}" if pp > 1 else ""   # a stage's ranks: its dp x tp
    damage.expect(world % (pp * manifest["tp"]) == 0, "tp", f"a divisor of world_size {world}{per_stage}",
                  manifest["tp"])
    damage.expect((world // pp) % manifest["ep"] == 0, "ep", f"a divisor of world_size {world}{per_stage}",
                  manifest["ep"])
    if "pp_layers" in manifest:
        damage.expect(len(manifest["pp_layers"]) == pp, "pp_layers", f"{pp} layer counts (one per stage)",
                      manifest["pp_layers"])
    want = f"{rank_file(0, world)} .. {rank_file(world - 1, world)}"
    damage.expect(len(manifest["files"]) == world, "files", want, manifest["files"])  # before a list of world names
    damage.expect(manifest["files"] == [rank_file(r, world) for r in range(world)], "files", want, manifest["files"])
    for name, entry in (manifest.get("checkpoint_tensors") or {}).items():
        field = f"checkpoint_tensors[{json.dumps(name)}]"
        damage.expect(isinstance(entry, dict), field, "an object with dtype and shape", entry)
        damage.expect(entry.get("dtype") in SAFETENSORS_TO_TORCH, field + ".dtype", "a safetensors dtype",
                      entry.get("dtype"))
        damage.expect(_is_shape(entry.get("shape")), field + ".shape", SHAPE, entry.get("shape"))
    stage_of = [(r // manifest["tp"]) % pp for r in range(world)]
    check_stages(damage, manifest, stage_of)
    for name, entry in manifest["params"].items():
        check_param(damage, manifest["params"], name, entry, stage_of)
        check_replicas(damage, name, entry, manifest["tp"] * pp)


def check_replicas(damage: _Damage, name: str, entry: dict, replica: int) -> None:
    """Data-parallel replicas (rank r and r % (tp x pp)) hold the same shard of a param that is not an expert's:
    records that differ say the manifest's tp or pp is not the save's (a tp-2 save claiming tp 1 reloaded "OK"
    with each rank's half as the whole)."""
    if entry.get("style") in ("expert", "rank0") or "ranks" not in entry:
        return
    for r, rec in enumerate(entry["ranks"]):
        lead = entry["ranks"][r % replica]
        if rec is None or lead is None or r < replica:
            continue
        same = rec.get("local_shape") == lead.get("local_shape") and rec.get("sha256") == lead.get("sha256")
        damage.expect(same, f"params[{json.dumps(name)}].ranks[{r}]", f"the shard of rank {r % replica}, its data-"
                      f"parallel replica at tp x pp = {replica} (the same local_shape and sha256)", rec)


def check_stages(damage: _Damage, manifest: dict, stage_of: list[int]) -> None:
    """A save of several pipeline stages says which layers each holds (pp_layers, rank_stages) and which stages
    each param is on (pp_ranks): a manifest claiming stages without them describes no save distload made."""
    pp = manifest.get("pp", 1)
    if pp == 1:
        return
    for key, want in (("pp_layers", f"{pp} layer counts"), ("rank_stages", "per rank its stage and layers")):
        if key not in manifest:
            raise damage(key, f"{want} (a save of pp {pp} records them)", missing=True)
    starts = [sum(manifest["pp_layers"][:s]) for s in range(pp)]
    for r, rec in enumerate(manifest["rank_stages"]):
        s = stage_of[r] if r < len(stage_of) else None
        want = {"pp_rank": s, "layers": [starts[s], starts[s] + manifest["pp_layers"][s]]} if s is not None else None
        damage.expect(rec == want, f"rank_stages[{r}]", f"{want} (from pp, tp and pp_layers)", rec)
    damage.expect(len(manifest["rank_stages"]) == len(stage_of), "rank_stages", f"{len(stage_of)} records",
                  manifest["rank_stages"])
    unplaced = [n for n, e in manifest["params"].items() if isinstance(e, dict) and "pp_ranks" not in e]
    if unplaced:
        raise damage(f"params[{json.dumps(unplaced[0])}].pp_ranks", f"the stages that hold it (a save of pp {pp} "
                     "records them for every param)", missing=True)


def check_param(damage: _Damage, params: dict, name: str, entry, stage_of: list[int]) -> None:
    """One param's record: style, dtype, global shape, and an alias or one record per rank (null on the ranks
    of the pipeline stages that lack it: those not in its pp_ranks). stage_of: per rank its stage."""
    world = len(stage_of)
    field = f"params[{json.dumps(name)}]"
    damage.expect(isinstance(entry, dict), field, "an object with style, dtype, global_shape", entry)
    damage.expect(entry.get("style") in STYLES, field + ".style", f"one of {', '.join(STYLES)}", entry.get("style"))
    damage.expect(entry.get("dtype") in SAFETENSORS_TO_TORCH, field + ".dtype",
                  f"a safetensors dtype ({', '.join(sorted(SAFETENSORS_TO_TORCH))})", entry.get("dtype"))
    shape = entry.get("global_shape")
    damage.expect(_is_shape(shape), field + ".global_shape", SHAPE, shape)
    stages = entry.get("pp_ranks", sorted(set(stage_of)))
    damage.expect(isinstance(stages, list) and all(isinstance(x, int) and x in stage_of for x in stages),
                  field + ".pp_ranks", f"the pipeline stages that hold it (0..{max(stage_of)})", stages)
    if "alias_of" in entry:
        to = entry["alias_of"]
        damage.expect(isinstance(to, str) and isinstance(params.get(to), dict) and "alias_of" not in params[to],
                      field + ".alias_of", "the name of a param that is not itself an alias", to)
        return
    ranks = entry.get("ranks")
    damage.expect(isinstance(ranks, list) and len(ranks) == world, field + ".ranks",
                  f"a list of one record per rank ({world})", ranks)
    for r, rec in enumerate(ranks):
        at = f"{field}.ranks[{r}]"
        if rec is None and stage_of[r] not in stages:
            continue   # another pipeline stage's param
        damage.expect(isinstance(rec, dict), at, "an object with local_shape and offset", rec)
        local = rec.get("local_shape")
        damage.expect(_is_shape(local) and len(local) == len(shape), at + ".local_shape",
                      f"{len(shape)} whole numbers >= 0 (as global_shape)", local)
        offset = rec.get("offset")
        if "offset" not in rec:
            raise damage(at + ".offset", "the byte offset in the rank file", missing=True)
        damage.expect(isinstance(offset, int) and not isinstance(offset, bool) and offset >= 0, at + ".offset",
                      "the byte offset in the rank file, a whole number >= 0", offset)
        if "sha256" in rec:
            damage.expect(isinstance(rec["sha256"], str) and len(rec["sha256"]) == 64, at + ".sha256",
                          "64 hex digits", rec["sha256"])
        if "experts" in rec:
            experts = rec["experts"]
            damage.expect(_is_shape(experts), at + ".experts", "a list of expert ids >= 0", experts)
