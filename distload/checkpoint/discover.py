"""Find the weight files of a checkpoint directory and index every tensor in them (DESIGN §2 step 2).

Safetensors are preferred over `.bin`/`.pt`. When an index json exists it is the authority: only the
files it names are read, and every tensor it names must be exactly where it says. Index paths are
untrusted: they must stay inside the checkpoint directory.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
from dataclasses import dataclass, field
from pathlib import Path

from distload.errors import CheckpointError
from distload.gc_freeze import collector_paused

from .header import TensorEntry, first_repeat, parse_safetensors_header
from .legacy import LEGACY_SUFFIXES, legacy_entries

log = logging.getLogger("distload")

SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_INDEX = "pytorch_model.bin.index.json"
# Hugging Face Trainer output dirs hold these next to the weights; they are pickles of optimizer state or
# Python objects (which weights_only refuses), never model weights.
TRAINER_ARTEFACTS = frozenset({"training_args.bin", "optimizer.pt", "scheduler.pt", "scaler.pt"})


@dataclass(frozen=True)
class CheckpointIndex:
    """Every tensor of a checkpoint: name -> file, dtype, shape, byte range."""

    root: str
    format: str  # "safetensors" | "torch"
    tensors: dict[str, TensorEntry]
    files: tuple[str, ...]
    ignored_files: tuple[str, ...]
    config: dict = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.tensors.values())


@collector_paused  # an index is one entry object per tensor and no cycles (gc_freeze.py)
def discover(root: str | os.PathLike) -> CheckpointIndex:
    """Index the checkpoint in directory `root` (safetensors first, then .bin/.pt)."""
    root = os.path.abspath(root)
    if not os.path.isdir(root):
        raise CheckpointError(f"{root}: checkpoint directory does not exist or is not a directory")
    present_safetensors = _top_level_files(root, (".safetensors",))
    present_legacy = _top_level_files(root, LEGACY_SUFFIXES)

    if os.path.exists(os.path.join(root, SAFETENSORS_INDEX)) or present_safetensors:
        fmt, index_name, present = "safetensors", SAFETENSORS_INDEX, present_safetensors
        others = present_legacy
    elif os.path.exists(os.path.join(root, TORCH_INDEX)) or present_legacy:
        fmt, index_name = "torch", TORCH_INDEX
        present = [f for f in present_legacy if f not in TRAINER_ARTEFACTS]
        others = [f for f in present_legacy if f in TRAINER_ARTEFACTS]
    else:
        raise CheckpointError(
            f"{root}: no *.safetensors, *.bin or *.pt weight files found; point distload at the directory "
            "that holds the model's weights (where config.json is)"
        )

    index_path = os.path.join(root, index_name)
    if os.path.exists(index_path):
        weight_map = _read_weight_map(index_path, index_name)
        files = sorted(set(weight_map.values()))
        for rel in files:
            resolve_inside(root, rel, source=f"{index_name} entry {rel!r}")
        per_file = {rel: _entries_of(root, rel, fmt, f"{index_name} names {rel!r}, which") for rel in files}
        tensors = _merge(per_file)
        _check_against_weight_map(tensors, weight_map, index_name)
    else:
        files = present
        for rel in files:
            resolve_inside(root, rel, source=f"weight file {rel!r}")
        tensors = _merge({rel: _entries_of(root, rel, fmt, f"weight file {rel!r}") for rel in files})

    ignored = tuple(sorted(set(present) - set(files) | set(others)))
    if ignored:
        log.warning(
            "checkpoint %s: ignoring weight files not used by the %s checkpoint%s: %s",
            root, fmt, f" ({index_name} is the authority)" if os.path.exists(index_path) else "", ", ".join(ignored),
        )
    if fmt == "safetensors":  # already in file order: files sorted, each header's entries by offset
        ordered = tensors
    else:
        ordered = dict(sorted(tensors.items(), key=lambda item: (item[1].file, item[1].offset)))
    return CheckpointIndex(root, fmt, ordered, tuple(files), ignored, read_config(root))


def resolve_inside(root: str, rel: str, source: str) -> str:
    """The real path of `rel` under `root`, or a CheckpointError if `rel` would leave the directory.

    `source` names where `rel` came from (an index file entry, a weight file) for the message.
    """
    fix = "the checkpoint's weight files must live inside its directory (fix the index, or copy the file in)"
    if not isinstance(rel, str) or not rel or os.path.isabs(rel) or rel.startswith(("/", "\\")):
        raise CheckpointError(f"{root}: {source}: absolute or empty paths are refused; {fix}")
    if ".." in rel.replace("\\", "/").split("/"):
        raise CheckpointError(f"{root}: {source}: paths containing '..' are refused; {fix}")
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(root, rel))
    if not (_is_within(real, real_root) or _is_hf_cache_blob(root, real)):
        raise CheckpointError(f"{root}: {source} is a symlink resolving to {real}, outside the checkpoint; {fix}")
    return real


def _is_within(path: str, directory: str) -> bool:
    return os.path.commonpath([path, directory]) == directory


def _is_hf_cache_blob(root: str, real: str) -> bool:
    # The Hugging Face hub cache stores files as `snapshots/<rev>/<name> -> ../../blobs/<sha>`: every file
    # of a cached checkpoint "escapes" its snapshot dir. Allow exactly that layout and nothing wider.
    snapshot_parent = Path(root).parent
    if snapshot_parent.name != "snapshots":
        return False
    blobs = os.path.realpath(snapshot_parent.parent / "blobs")
    return os.path.isdir(blobs) and _is_within(real, blobs)


def _top_level_files(root: str, suffixes: tuple[str, ...]) -> list[str]:
    with os.scandir(root) as it:
        return sorted(e.name for e in it if e.name.endswith(suffixes) and not e.is_dir())


def _no_duplicate_keys(index_name: str):
    def hook(pairs: list[tuple[str, object]]) -> dict:
        obj = dict(pairs)
        if len(obj) == len(pairs):
            return obj
        key, value = pairs[first_repeat(pairs)]
        first = next(v for k, v in pairs if k == key)
        if first != value and isinstance(value, str):
            raise CheckpointError(
                f"{index_name}: tensor {key!r} is mapped to two files, {first!r} and {value!r}; "
                "keep one of them in the weight_map"
            )
        raise CheckpointError(f"{index_name}: duplicate key {key!r}; fix or re-download the index")

    return hook


def _read_weight_map(index_path: str, index_name: str) -> dict[str, str]:
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f, object_pairs_hook=_no_duplicate_keys(index_name))
    except (OSError, ValueError) as e:  # ValueError: bad UTF-8, bad JSON, absurd number literals
        raise CheckpointError(f"{index_path}: cannot read index ({e}); fix or re-download it") from e
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_path}: expected a non-empty 'weight_map' object (tensor name -> file)")
    for name, rel in weight_map.items():
        if not isinstance(rel, str):
            raise CheckpointError(f"{index_path}: weight_map[{name!r}] must be a file name, got {rel!r:.100}")
    spelled = {rel: normalized(rel) for rel in set(weight_map.values())}   # a few files, many tensors each
    return {name: spelled[rel] for name, rel in weight_map.items()}


def normalized(rel: str) -> str:
    """One spelling per file ('./f' and 'f' are one file, read once); a path with '..', or an absolute or
    empty one, is kept as written for resolve_inside to refuse by the name the index gave."""
    if not rel or rel.startswith(("/", "\\")) or ".." in rel.replace("\\", "/").split("/"):
        return rel
    return posixpath.normpath(rel)


def _entries_of(root: str, rel: str, fmt: str, source: str) -> dict[str, TensorEntry]:
    path = os.path.join(root, rel)
    if not os.path.isfile(path):
        raise CheckpointError(f"{root}: {source} is missing (or not a file); finish or repeat the download")
    if fmt == "safetensors":
        return parse_safetensors_header(path, display_name=rel)
    return legacy_entries(root, rel)


def _merge(per_file: dict[str, dict[str, TensorEntry]]) -> dict[str, TensorEntry]:
    tensors: dict[str, TensorEntry] = {}
    for rel, entries in per_file.items():
        for name, entry in entries.items():
            if name in tensors:
                raise CheckpointError(
                    f"tensor {name!r} is stored in two files, {tensors[name].file!r} and {rel!r}; "
                    "remove the stale file (or list only one of them in the index)"
                )
            tensors[name] = entry
    return tensors


def _check_against_weight_map(tensors: dict[str, TensorEntry], weight_map: dict[str, str], index_name: str) -> None:
    if len(tensors) == len(weight_map) and all(name in tensors and tensors[name].file == rel
                                               for name, rel in weight_map.items()):
        return  # they agree: the sorted walk below only picks the first disagreement to name
    for name, rel in sorted(weight_map.items()):
        if name not in tensors or tensors[name].file != rel:
            raise CheckpointError(
                f"{index_name}: weight_map puts tensor {name!r} in {rel!r}, but that file has no such tensor; "
                "the index and the weight files disagree, re-download them together"
            )
    for name, entry in sorted(tensors.items()):
        if name not in weight_map:
            raise CheckpointError(
                f"{index_name}: file {entry.file!r} holds tensor {name!r}, which the weight_map does not list; "
                "the index and the weight files disagree, re-download them together"
            )


def read_config(root: str) -> dict:
    path = os.path.join(root, "config.json")
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:  # ValueError: bad UTF-8, bad JSON, absurd number literals
        raise CheckpointError(f"{path}: config.json is not valid JSON ({e}); fix or re-download it") from e
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: config.json must hold a JSON object, got {type(config).__name__}")
    return config
