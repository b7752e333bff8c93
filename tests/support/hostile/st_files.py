"""Writing hostile checkpoint files: raw safetensors headers, the index, config.json."""

from __future__ import annotations

import json
from pathlib import Path

INDEX = "model.safetensors.index.json"


def read_st(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_st(path: Path, header: dict | bytes, data: bytes, claimed_length: int | None = None) -> None:
    text = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    length = len(text) if claimed_length is None else claimed_length
    path.write_bytes(length.to_bytes(8, "little") + text + data)


def index(ckpt: Path) -> dict:
    return json.loads((ckpt / INDEX).read_text())


def write_index(ckpt: Path, value) -> None:
    (ckpt / INDEX).write_text(value if isinstance(value, str) else json.dumps(value))


def file_of(ckpt: Path, tensor: str) -> Path:
    return ckpt / index(ckpt)["weight_map"][tensor]


def edit_config(ckpt: Path, **changes) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    for key, value in changes.items():
        if value is DROP:
            config.pop(key, None)
        else:
            config[key] = value
    (ckpt / "config.json").write_text(json.dumps(config))


DROP = object()  # edit_config(key=DROP) removes the key


def edit_entry(ckpt: Path, tensor: str, **changes) -> None:
    """Change one tensor's header entry in place (dtype, shape, data_offsets), keeping every byte of data."""
    path = file_of(ckpt, tensor)
    header, data = read_st(path)
    header[tensor].update(changes)
    write_st(path, header, data)


def replace_tensor(ckpt: Path, tensor: str, value) -> None:
    """Store `value` (any shape / dtype) under `tensor`'s name, in the file the index names for it."""
    from safetensors.torch import load_file, save_file

    path = file_of(ckpt, tensor)
    tensors = load_file(path)
    tensors[tensor] = value.contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})


def damage_header(ckpt: Path, fn) -> Path:
    """fn(header dict) -> new header (dict or bytes) for the largest weight file; data kept."""
    path = max(sorted(ckpt.glob("*.safetensors")), key=lambda p: p.stat().st_size)
    header, data = read_st(path)
    write_st(path, fn(header), data)
    return path


def first_tensor(header: dict) -> str:
    return min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
