"""Our own safetensors header parser: validate everything before a single tensor byte is read (DESIGN §5).

A safetensors file is `u64 little-endian header length | JSON header | data section`. The header is
untrusted input: a hostile or truncated file must fail here with a message naming the file, the tensor
and the cause, never later as a wrong tensor or an out-of-bounds read.
"""

from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from distload.dtypes import SAFETENSORS_TO_TORCH, itemsize
from distload.errors import CheckpointError

# Real headers are a few MiB at most (tens of thousands of tensors); a larger claim is corruption or an
# attempt to make us allocate memory, so we refuse before reading it.
MAX_HEADER_BYTES = 100 * 1024 * 1024
LENGTH_PREFIX_BYTES = 8
_ENTRY_KEYS = frozenset({"dtype", "shape", "data_offsets"})


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a checkpoint: where its bytes lie (absolute offset in `file`) and what they are."""

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def parse_safetensors_header(path: str | os.PathLike, display_name: str | None = None) -> dict[str, TensorEntry]:
    """Parse and validate the header of one safetensors file; entries sorted by offset."""
    path = Path(path)
    shown = display_name or path.name
    header_bytes, file_size = _read_header_bytes(path, shown)
    return entries_from_header(header_bytes, file_size, shown)


def header_metadata(path: str | os.PathLike, display_name: str | None = None) -> dict[str, str]:
    """A safetensors file's __metadata__ ({} when it has none), by the same one bounded read of its header."""
    path = Path(path)
    shown = display_name or path.name
    header_bytes, _ = _read_header_bytes(path, shown)
    _decode_header(header_bytes, shown)   # checked as a header (it drops the metadata it checks)
    return json.loads(header_bytes).get("__metadata__") or {}


def entries_from_header(header_bytes: bytes, file_size: int, shown: str) -> dict[str, TensorEntry]:
    """The validated entries of a header (the bytes after the 8-byte length) of a `file_size`-byte file, however
    they were fetched (a file, an object store's ranged GET)."""
    header = _decode_header(header_bytes, shown)
    data_start = LENGTH_PREFIX_BYTES + len(header_bytes)
    return _build_entries(header, shown, data_start, file_size - data_start)


def header_length(prefix: bytes, file_size: int, shown: str) -> int:
    """The header length a file's first 8 bytes claim, checked against the cap and the file's size."""
    if len(prefix) < LENGTH_PREFIX_BYTES:
        raise CheckpointError(
            f"{shown}: file is {file_size} bytes, shorter than the 8-byte header length of a safetensors "
            "file (truncated download?); re-download or re-save the file"
        )
    header_len = int.from_bytes(prefix[:LENGTH_PREFIX_BYTES], "little")
    if header_len > MAX_HEADER_BYTES:
        raise CheckpointError(
            f"{shown}: header length {header_len} bytes exceeds the {MAX_HEADER_BYTES}-byte cap "
            "(corrupt or not a safetensors file); re-download or re-save the file"
        )
    if LENGTH_PREFIX_BYTES + header_len > file_size:
        raise CheckpointError(
            f"{shown}: header length {header_len} bytes runs past the end of the {file_size}-byte file "
            "(truncated or not a safetensors file); re-download the file"
        )
    return header_len


def _read_header_bytes(path: Path, shown: str) -> tuple[bytes, int]:
    try:
        # Stat before open: opening a FIFO or device named *.safetensors could block or read forever.
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise CheckpointError(f"{shown}: not a regular file ({path}); remove it from the checkpoint directory")
        with open(path, "rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            header_len = header_length(f.read(LENGTH_PREFIX_BYTES), file_size, shown)
            header_bytes = f.read(header_len)  # the one bounded read of the header; tensor data is never touched
    except OSError as e:
        raise CheckpointError(f"{shown}: cannot read safetensors header: {e}") from e
    if len(header_bytes) != header_len:
        raise CheckpointError(f"{shown}: file shrank while reading its {header_len}-byte header; is it being written?")
    return header_bytes, file_size


def first_repeat(pairs: list[tuple[str, object]]) -> int:
    """The index of the first pair whose key an earlier pair has (pairs with a repeated key)."""
    seen = set()
    for i, (key, _) in enumerate(pairs):
        if key in seen:
            return i
        seen.add(key)
    raise ValueError("no repeated key")


def _reject_duplicate_keys(shown: str):
    def hook(pairs: list[tuple[str, object]]) -> dict:
        obj = dict(pairs)
        if len(obj) != len(pairs):
            # json.loads would silently keep the last one: two tensors could then claim the same name.
            key = pairs[first_repeat(pairs)][0]
            raise CheckpointError(f"{shown}: header has duplicate key {key!r}; the file is corrupt, re-save it")
        return obj

    return hook


def _decode_header(header_bytes: bytes, shown: str) -> dict:
    try:
        text = header_bytes.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{shown}: header is not valid UTF-8 ({e}); not a safetensors file?") from e
    try:
        header = json.loads(text, object_pairs_hook=_reject_duplicate_keys(shown))
    except ValueError as e:  # JSONDecodeError, or an integer literal too long to convert (hostile)
        raise CheckpointError(f"{shown}: header is not valid JSON ({str(e):.200}); not a safetensors file?") from e
    except RecursionError as e:  # deeply nested hostile JSON
        raise CheckpointError(f"{shown}: header JSON is nested too deeply; not a safetensors file") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{shown}: header must be a JSON object, got {type(header).__name__}")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise CheckpointError(f"{shown}: __metadata__ must map strings to strings, got {metadata!r:.200}")
    return header


def _is_count(value: object) -> bool:
    # bool is an int subclass; `true` as a dimension is corruption, not 1.
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _validated_entry(name: str, raw: object, shown: str) -> tuple[str, tuple[int, ...], int, int]:
    where = f"{shown}: tensor {name!r}"
    if not isinstance(raw, dict) or raw.keys() != _ENTRY_KEYS:
        got = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        raise CheckpointError(f"{where}: entry must have exactly keys ['data_offsets', 'dtype', 'shape'], got {got}")
    dtype, shape, offsets = raw["dtype"], raw["shape"], raw["data_offsets"]
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_TO_TORCH:
        raise CheckpointError(
            f"{where}: dtype {dtype!r} is not supported (supported: {', '.join(sorted(SAFETENSORS_TO_TORCH))})"
        )
    # _is_count, inline (it runs for every dimension of every tensor): JSON gives plain ints or bools.
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise CheckpointError(f"{where}: shape must be a list of non-negative integers, got {shape!r:.200}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and _is_count(offsets[0]) and _is_count(offsets[1])):
        raise CheckpointError(f"{where}: data_offsets must be [begin, end] non-negative integers, got {offsets!r:.200}")
    begin, end = offsets
    if end < begin:
        raise CheckpointError(f"{where}: data_offsets [{begin}, {end}] end before they begin")
    expected = math.prod(shape) * itemsize(dtype)
    if end - begin != expected:
        raise CheckpointError(
            f"{where}: data_offsets [{begin}, {end}] span {end - begin} bytes but shape {shape} of {dtype} "
            f"needs {expected}; the file is corrupt, re-save it"
        )
    return dtype, tuple(shape), begin, end


def _build_entries(header: dict, shown: str, data_start: int, data_size: int) -> dict[str, TensorEntry]:
    spans = []
    for name, raw in header.items():
        dtype, shape, begin, end = _validated_entry(name, raw, shown)
        if end > data_size:
            raise CheckpointError(
                f"{shown}: tensor {name!r}: data_offsets [{begin}, {end}] run past the {data_size}-byte data "
                "section (truncated file?); re-download the file"
            )
        spans.append((begin, end, name, dtype, shape))
    # Zero-byte tensors share their begin with a neighbour; sorting by end too keeps them first.
    spans.sort()
    cursor, previous = 0, None
    for begin, end, name, _, _ in spans:
        if begin != cursor:
            kind = "overlaps" if begin < cursor else f"leaves a {begin - cursor}-byte gap after"
            after = repr(previous) if previous else "the start of the data section"
            raise CheckpointError(
                f"{shown}: tensor {name!r} (data_offsets begin {begin}) {kind} {after} (which ends at {cursor}); "
                "the file is corrupt, re-save it"
            )
        cursor, previous = end, name
    if cursor != data_size:
        raise CheckpointError(
            f"{shown}: tensors end at data byte {cursor} but the data section is {data_size} bytes "
            f"({data_size - cursor} trailing bytes); the file is corrupt or was appended to, re-save it"
        )
    return {
        name: TensorEntry(name, shown, dtype, shape, data_start + begin, end - begin)
        for begin, end, name, dtype, shape in spans
    }
