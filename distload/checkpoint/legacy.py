"""Legacy `.bin`/`.pt` checkpoints, loaded only through `torch.load(weights_only=True)` (DESIGN §5).

A pickle can run arbitrary code when loaded; `weights_only=True` makes torch refuse anything but tensors
and plain containers, and we never retry without it. To let the rest of distload treat these files like
safetensors, each file gets a *virtual byte space*: its tensors in sorted name order, each made
contiguous, laid end to end. `TensorEntry.offset` points into that space and `LegacyFile.read_into`
serves byte ranges of it.
"""

from __future__ import annotations

import bisect
import os
import pickle
import threading
import zipfile

import torch

from distload.dtypes import TORCH_TO_SAFETENSORS
from distload.errors import CheckpointError

from .header import TensorEntry

LEGACY_SUFFIXES = (".bin", ".pt")


def is_legacy_file(relfile: str) -> bool:
    return relfile.endswith(LEGACY_SUFFIXES)


def load_legacy_file(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Load a `.bin`/`.pt` state dict safely (weights_only, memory-mapped where the format allows)."""
    path = os.fspath(path)
    # mmap needs the zip container of torch.save (the default since torch 1.6); older files are read whole.
    use_mmap = zipfile.is_zipfile(path)
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=use_mmap)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path}: refusing to load: the pickle wants to create objects other than tensors, and distload "
            "refuses to execute code from a checkpoint (torch.load weights_only=True rejected it). Convert "
            f"the checkpoint to safetensors with a trusted tool, or re-save it as a plain state dict. ({_why(e)})"
        ) from e
    except Exception as e:  # corrupt zip, truncated pickle, ...: torch raises many types
        raise CheckpointError(f"{path}: cannot load as a torch checkpoint ({type(e).__name__}: {e})") from e
    if not isinstance(loaded, dict):
        raise CheckpointError(f"{path}: expected a state dict (name -> tensor), got {type(loaded).__name__}")
    for name, value in loaded.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"{path}: entry {name!r} is a {type(value).__name__}, not a tensor; distload reads flat state "
                "dicts only (nested trainer checkpoints: save model.state_dict() instead)"
            )
        if value.dtype not in TORCH_TO_SAFETENSORS:
            raise CheckpointError(
                f"{path}: tensor {name!r} has dtype {value.dtype}, which distload does not support "
                f"(supported: {', '.join(sorted(str(d) for d in TORCH_TO_SAFETENSORS))})"
            )
    return loaded


def _why(error: Exception) -> str:
    # torch's message also suggests retrying with weights_only=False, the one thing we must not advise.
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return next((line for line in lines if "unsupported" in line.lower()), lines[0] if lines else type(error).__name__)


class LegacyFile:
    """One loaded legacy file, serving byte ranges of its virtual layout."""

    def __init__(self, path: str | os.PathLike, relfile: str):
        self.path = os.fspath(path)
        tensors = load_legacy_file(self.path)
        self.names = sorted(tensors)
        # Flat uint8 views: fp8 and bool reinterpret fine, and a copy only happens for non-contiguous tensors.
        self._bytes = [tensors[n].contiguous().view(-1).view(torch.uint8) for n in self.names]
        self._starts = []
        offset = 0
        entries = {}
        for name, flat in zip(self.names, self._bytes):
            t = tensors[name]
            self._starts.append(offset)
            dtype = TORCH_TO_SAFETENSORS[t.dtype]
            entries[name] = TensorEntry(name, relfile, dtype, tuple(t.shape), offset, flat.numel())
            offset += flat.numel()
        self.entries: dict[str, TensorEntry] = entries
        self.size = offset

    def read_into(self, offset: int, out: memoryview | torch.Tensor) -> int:
        """Copy virtual bytes [offset, offset + len(out)) into `out`; returns the count."""
        dest = _as_uint8_tensor(out)
        wanted = dest.numel()
        if offset < 0 or offset + wanted > self.size:
            raise CheckpointError(
                f"{self.path}: read of {wanted} bytes at virtual offset {offset} runs past the end "
                f"({self.size} bytes of tensors)"
            )
        done = 0
        index = bisect.bisect_right(self._starts, offset) - 1
        while done < wanted:
            flat = self._bytes[index]
            inside = offset + done - self._starts[index]
            take = min(flat.numel() - inside, wanted - done)
            if take > 0:
                dest[done : done + take].copy_(flat[inside : inside + take])
                done += take
            index += 1
        return wanted


def _as_uint8_tensor(out: memoryview | torch.Tensor) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        if out.dtype != torch.uint8 or not out.is_contiguous():
            raise TypeError(f"out must be a contiguous uint8 tensor, got {out.dtype} contiguous={out.is_contiguous()}")
        return out.view(-1)
    if out.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(out, dtype=torch.uint8)


# Discovery and reading both need the same file; loading it once keeps a reader rank at one mapping of it.
_cache: dict[tuple[str, str], LegacyFile] = {}
_cache_lock = threading.Lock()


def open_legacy(path: str | os.PathLike, relfile: str) -> LegacyFile:
    """The cached LegacyFile for `path` (loaded on first use)."""
    key = (os.path.realpath(path), relfile)
    with _cache_lock:
        if key not in _cache:
            _cache[key] = LegacyFile(path, relfile)
        return _cache[key]


def forget_legacy(path: str | os.PathLike, relfile: str) -> None:
    """Drop a cached file so its tensors can be freed."""
    with _cache_lock:
        _cache.pop((os.path.realpath(path), relfile), None)


def legacy_entries(root: str | os.PathLike, relfile: str) -> dict[str, TensorEntry]:
    """Entries of one legacy file in its virtual layout (sorted names, offsets = running sum of nbytes)."""
    return dict(open_legacy(os.path.join(root, relfile), relfile).entries)
