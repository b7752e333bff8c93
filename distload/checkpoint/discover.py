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


class DirectoryFiles:
    """A checkpoint directory as discovery reads it: its top-level files, a file's bytes, the headers of its weight
    files. An object store's prefix answers the same questions (checkpoint/s3/listing.py)."""

    def __init__(self, root: str):
        self.root = root

    def names(self) -> list[str]:
        with os.scandir(self.root) as it:
            return sorted(e.name for e in it if not e.is_dir())

    def where(self, name: str) -> str:
        return os.path.join(self.root, name)

    def read(self, name: str) -> bytes | None:
        """The file's bytes; None when there is no such file."""
        path = self.where(name)
        if not os.path.exists(path):
            return None
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read it ({e}); fix or re-download it") from e

    def check_inside(self, rel: str, source: str) -> None:
        resolve_inside(self.root, rel, source)

    def entries(self, rels: list[str], fmt: str, sources: dict[str, str]) -> dict[str, dict[str, TensorEntry]]:
        return {rel: _entries_of(self.root, rel, fmt, sources[rel]) for rel in rels}


@collector_paused  # an index is one entry object per tensor and no cycles (gc_freeze.py)
def discover(root: str | os.PathLike) -> CheckpointIndex:
    """Index the checkpoint in directory `root` (safetensors first, then .bin/.pt)."""
    root = os.path.abspath(root)
    if not os.path.isdir(root):
        raise CheckpointError(f"{root}: checkpoint directory does not exist or is not a directory")
    return index_checkpoint(DirectoryFiles(root))


def index_checkpoint(files) -> CheckpointIndex:
    """Index the checkpoint whose files `files` reads (DirectoryFiles, or an object store's prefix): the index
    json is the authority where there is one, its paths stay inside the checkpoint, every header is validated."""
    root, names = files.root, files.names()
    present_safetensors = [n for n in names if n.endswith(".safetensors")]
    present_legacy = [n for n in names if n.endswith(LEGACY_SUFFIXES)]

    if SAFETENSORS_INDEX in names or present_safetensors:
        fmt, index_name, present = "safetensors", SAFETENSORS_INDEX, present_safetensors
        others = present_legacy
    elif TORCH_INDEX in names or present_legacy:
        fmt, index_name = "torch", TORCH_INDEX
        present = [f for f in present_legacy if f not in TRAINER_ARTEFACTS]
        others = [f for f in present_legacy if f in TRAINER_ARTEFACTS]
    else:
        raise CheckpointError(
            f"{root}: no *.safetensors, *.bin or *.pt weight files found; point distload at the directory "
            "that holds the model's weights (where config.json is)"
        )

    indexed = index_name in names
    if indexed:
        weight_map = parse_weight_map(files.read(index_name), files.where(index_name), index_name)
        files_used = sorted(set(weight_map.values()))
        sources = {rel: f"{index_name} entry {rel!r}" for rel in files_used}
        for rel in files_used:
            files.check_inside(rel, sources[rel])
        per_file = files.entries(files_used, fmt, {rel: f"{index_name} names {rel!r}, which" for rel in files_used})
        tensors = _merge(per_file)
        _check_against_weight_map(tensors, weight_map, index_name)
    else:
        files_used = present
        for rel in files_used:
            files.check_inside(rel, f"weight file {rel!r}")
        tensors = _merge(files.entries(files_used, fmt, {rel: f"weight file {rel!r}" for rel in files_used}))

    ignored = tuple(sorted(set(present) - set(files_used) | set(others)))
    if ignored:
        log.warning(
            "checkpoint %s: ignoring weight files not used by the %s checkpoint%s: %s",
            root, fmt, f" ({index_name} is the authority)" if indexed else "", ", ".join(ignored),
        )
    if fmt == "safetensors":  # already in file order: files sorted, each header's entries by offset
        ordered = tensors
    else:
        ordered = dict(sorted(tensors.items(), key=lambda item: (item[1].file, item[1].offset)))
    config = parse_config(files.read("config.json"), files.where("config.json"))
    return CheckpointIndex(root, fmt, ordered, tuple(files_used), ignored, config)


def resolve_inside(root: str, rel: str, source: str) -> str:
    """The real path of `rel` under `root`, or a CheckpointError if `rel` would leave the directory.

    `source` names where `rel` came from (an index file entry, a weight file) for the message.
    """
    check_relative(root, rel, source)
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(root, rel))
    if not (_is_within(real, real_root) or _is_hf_cache_blob(root, real)):
        raise CheckpointError(f"{root}: {source} is a symlink resolving to {real}, outside the checkpoint; "
                              f"{INSIDE_FIX}")
    return real


INSIDE_FIX = "the checkpoint's weight files must live inside its directory (fix the index, or copy the file in)"


def check_relative(root: str, rel: str, source: str) -> None:
    """CheckpointError unless `rel` is a relative path that names no parent (no '..', not absolute, not empty)."""
    if not isinstance(rel, str) or not rel or os.path.isabs(rel) or rel.startswith(("/", "\\")):
        raise CheckpointError(f"{root}: {source}: absolute or empty paths are refused; {INSIDE_FIX}")
    if ".." in rel.replace("\\", "/").split("/"):
        raise CheckpointError(f"{root}: {source}: paths containing '..' are refused; {INSIDE_FIX}")


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


def parse_weight_map(raw: bytes, index_path: str, index_name: str) -> dict[str, str]:
    """The weight_map of an index json's bytes (tensor name -> file, one spelling per file)."""
    try:
        index = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys(index_name))
    except ValueError as e:  # bad UTF-8, bad JSON, absurd number literals
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
    """config.json of directory `root` ({} where there is none)."""
    files = DirectoryFiles(root)
    return parse_config(files.read("config.json"), files.where("config.json"))


def parse_config(raw: bytes | None, path: str) -> dict:
    """config.json's bytes as a dict ({} for None: no config.json)."""
    if raw is None:
        return {}
    try:
        config = json.loads(raw.decode("utf-8"))
    except ValueError as e:  # bad UTF-8, bad JSON, absurd number literals
        raise CheckpointError(f"{path}: config.json is not valid JSON ({e}); fix or re-download it") from e
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: config.json must hold a JSON object, got {type(config).__name__}")
    return config
