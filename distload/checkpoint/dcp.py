"""torch.distributed.checkpoint (DCP) directories as input: `distload load DCP_DIR --hf-config DIR`.

What DCP's FileSystemWriter (dcp.save, FSDP, torchtitan; torch 2.x) puts on disk, and how it is read here:

- `.metadata` is a *pickle* of `Metadata`: per state-dict key its dtype, global size and chunks (offsets,
  sizes), and per chunk the relative file, byte offset and length in a `__{rank}_{k}.distcp` file. A pickle
  can run code, so it is loaded by an allowlist unpickler that knows the DCP metadata classes and nothing else.
- By default every tensor chunk is a complete `torch.save` archive (a zip; entries stored uncompressed, data
  64-byte aligned) at that byte range, not raw bytes. `torch.load(weights_only=True)` of the range would be
  safe but materialises each chunk whole, so instead the zip's directory locates `data/<key>` and its
  `data.pkl` is parsed by a second allowlist unpickler that records the `_rebuild_tensor_v2/v3` arguments
  (storage offset, size, stride) without executing anything. A chunk must be row-major contiguous; then its
  raw bytes are read straight from the file into the usual bounded staging buffers, on reader ranks only.
- A tensor's chunks must split dim 0 only (one chunk from a single-process save; FSDP / FSDP2 `Shard(0)`
  otherwise): then the tensor's bytes are its chunks' bytes in row order. Each tensor gets a range of one
  virtual byte space (ordered by first chunk file and offset, so reads stay sequential); `DcpReader` maps a
  read of that space onto the chunks' file ranges, so the planner and transfer engine see a normal index.
- Keys: `dcp.save(model.state_dict())` keeps Hugging Face names; app-state wrapping (`{"model": sd, ...}`)
  prefixes them (`model.model.embed_tokens.weight`). The prefix used is the one (none, or the first one or
  two dotted components) under which most keys match the rules' checkpoint names; keys outside it (optimizer
  state, counters) are ignored, and named in the log. config.json comes from `--hf-config DIR`.
"""

from __future__ import annotations

import bisect
import io
import logging
import math
import os
import pathlib
import pickle
import struct
import zipfile
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..rules import names
from ..dtypes import TORCH_TO_SAFETENSORS
from ..errors import CheckpointError
from ..rules import rules_for
from .discover import CheckpointIndex, read_config, resolve_inside
from .header import TensorEntry
from .reader import RangeReader, ReaderWrapper

log = logging.getLogger("distload")

METADATA_FILE = ".metadata"
VIRTUAL_FILE = "dcp-tensors"     # the one virtual file every DCP tensor entry points into
_ZIP_LOCAL_HEADER = b"PK\x03\x04"


def is_dcp(path: str | os.PathLike) -> bool:
    return os.path.isfile(os.path.join(path, METADATA_FILE))


# ----------------------------------------------------------------------------------------------------
# Allowlist unpicklers


def _metadata_allowlist() -> dict[tuple[str, str], object]:
    import torch.distributed.checkpoint.filesystem as fs
    import torch.distributed.checkpoint.metadata as md

    allowed = {("torch.distributed.checkpoint.metadata", n): getattr(md, n) for n in (
        "Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")}
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = fs._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    allowed[("collections", "OrderedDict")] = OrderedDict
    for cls in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):  # StorageMeta.checkpoint_id
        allowed[("pathlib", cls)] = getattr(pathlib, cls)
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, where: str):
        super().__init__(file)
        self.where, self.allowed = where, _metadata_allowlist()

    def find_class(self, module, name):
        if (module, name) in self.allowed:
            return self.allowed[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(f"{self.where}: refusing to unpickle {module}.{name}: only DCP metadata classes are "
                              f"allowed (distload never runs code from a checkpoint); is this a DCP checkpoint?")


def read_metadata(root: str):
    path = os.path.join(root, METADATA_FILE)
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f, path).load()
    except CheckpointError:
        raise
    except Exception as exc:  # truncated or foreign pickles raise many types
        raise CheckpointError(f"{path}: cannot read DCP metadata ({type(exc).__name__}: {exc})") from exc
    from torch.distributed.checkpoint.metadata import Metadata  # heavy import: only for DCP directories

    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


@dataclass(frozen=True)
class _Rebuild:
    storage_key: str
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _TensorPickle(pickle.Unpickler):
    """Reads one torch.save'd tensor's data.pkl as the arguments of its rebuild call; executes nothing."""

    def find_class(self, module, name):
        if (module, name) in (("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor_v3")):
            return lambda storage, offset, size, stride, *rest: _Rebuild(storage, offset, tuple(size), tuple(stride))
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        if module in ("torch", "torch.storage") and name.endswith("Storage"):
            return name  # the storage class only names the dtype, which the DCP metadata gives too
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"unexpected global {module}.{name} in a tensor archive")

    def persistent_load(self, pid):
        # ('storage', storage_type, key, location, numel)
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r:.80}")
        return str(pid[2])


class _Window(io.RawIOBase):
    """Bytes [start, start + length) of an open file, as a seekable file of their own (for zipfile)."""

    def __init__(self, fh, start: int, length: int):
        self.fh, self.start, self.length, self.pos = fh, start, length, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, offset, whence=0):
        self.pos = {0: offset, 1: self.pos + offset, 2: self.length + offset}[whence]
        return self.pos

    def tell(self):
        return self.pos

    def readinto(self, b):
        n = max(0, min(len(b), self.length - self.pos))
        self.fh.seek(self.start + self.pos)
        got = self.fh.readinto(memoryview(b)[:n])
        self.pos += got
        return got


def contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a row-major tensor of `size`, in elements."""
    strides, acc = [], 1
    for n in reversed(size):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def _raw_offset(fh, start: int, length: int, dtype: torch.dtype, sizes: tuple[int, ...], where: str) -> int:
    """Absolute file offset of a chunk's raw row-major bytes inside its torch.save archive."""
    nbytes = math.prod(sizes) * dtype.itemsize
    fh.seek(start)
    if fh.read(4) != _ZIP_LOCAL_HEADER:
        raise CheckpointError(f"{where}: not a torch.save archive (DCP written with a serialization format other "
                              f"than the default torch_save?); save with the default FileSystemWriter, or as HF "
                              f"safetensors")
    try:
        archive = zipfile.ZipFile(_Window(fh, start, length))
        pkl = next(i for i in archive.infolist() if i.filename.endswith("/data.pkl"))
        prefix = pkl.filename[: -len("data.pkl")]
        order = next((archive.read(i) for i in archive.infolist() if i.filename == prefix + "byteorder"), b"little")
        rebuild = _TensorPickle(io.BytesIO(archive.read(pkl))).load()
        entry = archive.getinfo(f"{prefix}data/{rebuild.storage_key}")
    except (zipfile.BadZipFile, pickle.UnpicklingError, StopIteration, KeyError, EOFError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{where}: cannot parse the chunk's torch.save archive ({type(exc).__name__}: {exc})") from exc
    if not isinstance(rebuild, _Rebuild) or order.strip() != b"little":
        raise CheckpointError(f"{where}: the archive does not hold one little-endian tensor")
    if rebuild.size != tuple(sizes):
        raise CheckpointError(f"{where}: archive tensor has size {list(rebuild.size)}, the metadata says {list(sizes)}")
    if any(s != c for s, c, n in zip(rebuild.stride, contiguous_strides(rebuild.size), rebuild.size) if n > 1):
        raise CheckpointError(f"{where}: stored with strides {list(rebuild.stride)} (not row-major, e.g. a transposed "
                              f"view); save contiguous tensors (.contiguous()) to load it with distload")
    if entry.compress_type != zipfile.ZIP_STORED:
        raise CheckpointError(f"{where}: tensor data is compressed in the archive; distload reads stored data only")
    if rebuild.storage_offset * dtype.itemsize + nbytes > entry.file_size:
        raise CheckpointError(f"{where}: archive storage holds {entry.file_size} bytes, the tensor needs "
                              f"{rebuild.storage_offset * dtype.itemsize + nbytes}")
    fh.seek(start + entry.header_offset)
    local = fh.read(30)
    if local[:4] != _ZIP_LOCAL_HEADER:
        raise CheckpointError(f"{where}: damaged zip local header")
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    return start + entry.header_offset + 30 + name_len + extra_len + rebuild.storage_offset * dtype.itemsize


# ----------------------------------------------------------------------------------------------------
# Discovery


@dataclass(frozen=True)
class DcpIndex(CheckpointIndex):
    """A CheckpointIndex whose entries point into one virtual file; `segments` map it onto the .distcp files:
    (virtual offset, nbytes, file, file offset), sorted."""
    segments: tuple[tuple[int, int, str, int], ...] = ()


def _model_prefix(keys: list[str], rules) -> str:
    """The key prefix under which most keys match the rules' checkpoint names ('' when none helps)."""
    templates = [p for rule in rules.params for p in rule.parts] + list(rules.drop)
    candidates = {""}
    for k in keys:
        parts = k.split(".")
        candidates.update(".".join(parts[:i]) + "." for i in (1, 2) if len(parts) > i)

    def score(prefix: str) -> int:
        return sum(1 for k in keys if k.startswith(prefix)
                   and any(names.match(t, k[len(prefix):]) is not None for t in templates))
    return max(sorted(candidates, key=len), key=score)


def discover_dcp(root: str | os.PathLike, hf_config: str | None = None, rules_path: str | None = None) -> DcpIndex:
    """Index a DCP directory: validate every chunk's placement before a tensor byte is read."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    root = os.path.abspath(root)
    config_dir = hf_config or root
    if not os.path.isfile(os.path.join(config_dir, "config.json")):
        raise CheckpointError(f"{root}: a DCP checkpoint has no config.json; pass --hf-config DIR, a directory "
                              f"holding the model's Hugging Face config.json")
    config = read_config(config_dir)
    metadata = read_metadata(root)
    tensors = {k: m for k, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    if not tensors:
        raise CheckpointError(f"{root}: the DCP checkpoint holds no tensors")
    prefix = _model_prefix(sorted(tensors), rules_for(config, rules_path))
    outside = sorted(k for k in metadata.state_dict_metadata if not k.startswith(prefix))
    if outside:
        log.info("DCP %s: model keys are under %r; ignoring %d other entries: %s", root, prefix, len(outside),
                 names.describe(outside))
    storage: dict[str, list] = {}
    for index, info in metadata.storage_data.items():
        storage.setdefault(index.fqn, []).append((tuple(index.offset or ()), info))

    ordered = []
    handles: dict[str, object] = {}
    try:
        for key in sorted(k for k in tensors if k.startswith(prefix)):
            ordered.append((key, _chunks_of(root, key, tensors[key], storage.get(key, []), handles)))
    finally:
        for fh in handles.values():
            fh.close()
    ordered.sort(key=lambda item: (item[1][0][1], item[1][0][2]) if item[1] else ("", 0))
    entries, segments, at = {}, [], 0
    for key, chunks in ordered:
        meta = tensors[key]
        dtype = TORCH_TO_SAFETENSORS.get(meta.properties.dtype)
        if dtype is None:
            raise CheckpointError(f"{root}: DCP tensor {key!r} has dtype {meta.properties.dtype}, which distload "
                                  f"does not support")
        shape = tuple(meta.size)
        nbytes = math.prod(shape) * meta.properties.dtype.itemsize
        name = key[len(prefix):]
        entries[name] = TensorEntry(name, VIRTUAL_FILE, dtype, shape, at, nbytes)
        for chunk_bytes, file, offset in chunks:
            segments.append((at, chunk_bytes, file, offset))
            at += chunk_bytes
    files = tuple(sorted({s[2] for s in segments}))
    return DcpIndex(root, "dcp", entries, files, (), config, tuple(s for s in segments if s[1]))


def _chunks_of(root: str, key: str, meta, stored: list, handles: dict) -> list[tuple[int, str, int]]:
    """(bytes, file, raw offset) of each chunk of one tensor, in row order; they must tile dim 0."""
    size = tuple(meta.size)
    dtype = meta.properties.dtype
    by_offset = {off: info for off, info in stored}
    out, next_row = [], 0
    for chunk in sorted(meta.chunks, key=lambda c: tuple(c.offsets)):
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        where = f"{root}: DCP tensor {key!r} chunk at {list(offsets)}"
        if size and (offsets[1:] != (0,) * (len(size) - 1) or sizes[1:] != size[1:]):
            raise CheckpointError(f"{where} (size {list(sizes)} of {list(size)}) splits a dim other than 0 "
                                  f"(tensor parallel?); distload reads DCP tensors split along dim 0 only "
                                  f"(FSDP); re-save with the model unsharded or sharded on dim 0")
        if size and offsets[0] != next_row:
            raise CheckpointError(f"{where}: chunks do not tile dim 0 (expected a chunk at row {next_row})")
        info = by_offset.get(offsets)
        if info is None:
            raise CheckpointError(f"{where}: the metadata has no storage entry for it; the checkpoint is damaged")
        if info.transform_descriptors:
            raise CheckpointError(f"{where}: stored with transforms {list(info.transform_descriptors)} "
                                  f"(compression?); distload reads untransformed chunks only")
        rel = info.relative_path
        path = resolve_inside(root, rel, source=f"{METADATA_FILE} entry {rel!r}")
        fh = handles.get(rel)
        if fh is None:
            fh = handles[rel] = open(path, "rb")
        if info.offset < 0 or info.offset + info.length > os.fstat(fh.fileno()).st_size:
            raise CheckpointError(f"{where}: byte range {info.offset}+{info.length} lies outside {rel}")
        raw = _raw_offset(fh, info.offset, info.length, dtype, sizes, where)
        out.append((math.prod(sizes) * dtype.itemsize, rel, raw))
        next_row += sizes[0] if size else 1
    if (size[0] if size else 1) != next_row:
        raise CheckpointError(f"{root}: DCP tensor {key!r}: chunks cover {next_row} of {size[0] if size else 1} rows")
    return out


# ----------------------------------------------------------------------------------------------------
# Reading


class DcpReader(ReaderWrapper):
    """Serves byte ranges of the virtual file from the .distcp files (through a RangeReader: its strategies,
    path checks and counters)."""

    def __init__(self, index: DcpIndex, strategy: str = "plain", exact: bool = False):
        super().__init__(RangeReader(index.root, strategy=strategy, exact=exact))
        self.segments = index.segments
        self._starts = [s[0] for s in index.segments]

    def read_into(self, entry_file: str, offset: int, out) -> int:
        if entry_file != VIRTUAL_FILE:
            raise CheckpointError(f"DCP read of unknown file {entry_file!r}")
        flat = out.view(-1) if isinstance(out, torch.Tensor) else torch.frombuffer(out, dtype=torch.uint8)
        wanted, done = flat.numel(), 0
        i = bisect.bisect_right(self._starts, offset) - 1
        while done < wanted:
            if i < 0 or i >= len(self.segments):
                raise CheckpointError(f"DCP read at virtual offset {offset + done} lies outside every chunk")
            vstart, nbytes, file, file_offset = self.segments[i]
            inside = offset + done - vstart
            take = min(nbytes - inside, wanted - done)
            if take <= 0:
                raise CheckpointError(f"DCP read at virtual offset {offset + done} lies outside every chunk")
            self.inner.read_into(file, file_offset + inside, flat[done:done + take])
            done += take
            i += 1
        return wanted
