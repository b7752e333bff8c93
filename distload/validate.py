"""Options and output paths checked before the rendezvous: a user's mistake is named, with its fix, on
every rank before any process waits for another, instead of surfacing as a traceback from deep inside a
phase (or, for an output path, only after the whole load).

Pure functions of their arguments and the file system; each raises OptionError naming the option.
validate_load_options runs them all and returns the parsed --expert-map.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

from .errors import DistloadError

BACKENDS = ("gloo", "nccl", "mpi", "ucc")
DEVICE_TYPES = ("cpu", "cuda")


class OptionError(DistloadError):
    """A command-line option (or its Python keyword) has a value distload cannot use."""


def check_timeout(seconds) -> float:
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not math.isfinite(seconds) \
            or seconds <= 0:
        raise OptionError(f"--timeout {seconds!r}: the process-group timeout must be a number of seconds above 0 "
                          "(e.g. --timeout 600)")
    return float(seconds)


def check_positive(option: str, value, example: str) -> None:
    """None (the default) or an int >= 1."""
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise OptionError(f"{option} {value!r}: must be a whole number of at least 1 (e.g. {option} {example})")


def check_readers(value) -> None:
    if value in ("per-node", "owners"):
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise OptionError(f"--readers {value!r}: choose 'per-node', 'owners' or a number of readers of at least 1")


def check_device(device: str | None) -> None:
    """None (the default) or a device torch can name, of a type distload loads to, that this host has."""
    if device is None:
        return
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise OptionError(f"--device {device!r}: not a device name; use cpu, cuda or cuda:N") from None
    if parsed.type not in DEVICE_TYPES:
        raise OptionError(f"--device {device!r}: distload loads to {' or '.join(DEVICE_TYPES)}; use cpu, cuda or cuda:N")
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise OptionError(f"--device {device!r}: this host has no CUDA device (or CUDA_VISIBLE_DEVICES hides "
                              "them); use --device cpu")
        if parsed.index is not None and parsed.index >= count:
            raise OptionError(f"--device {device!r}: this host has {count} CUDA device(s), cuda:0..cuda:{count - 1}; "
                              "leave --device out to use cuda:LOCAL_RANK")


def check_backend(backend: str | None) -> None:
    if backend is not None and backend not in BACKENDS:
        raise OptionError(f"--backend {backend!r}: choose one of {', '.join(BACKENDS)} (default: nccl on CUDA, "
                          "gloo on CPU)")


def read_expert_map(path: str, world: int | None = None) -> list[list[int]]:
    """--expert-map FILE: JSON, a list (one entry per rank) of lists of global expert ids, or {"ranks": that};
    each expert hosted by one rank only."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise OptionError(f"--expert-map {path}: cannot read it ({e.strerror or e}); pass the EPLB JSON file") from None
    except UnicodeDecodeError:
        raise OptionError(f"--expert-map {path}: not text; pass the EPLB JSON file") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise OptionError(f"--expert-map {path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    shape = 'a list per rank of global expert ids, e.g. [[0, 1], [2, 3]], or {"ranks": [[0, 1], [2, 3]]}'
    if isinstance(data, dict):
        if "ranks" not in data:
            raise OptionError(f"--expert-map {path}: a JSON object needs the key 'ranks' ({shape})")
        data = data["ranks"]
    if not isinstance(data, list) or not all(isinstance(ids, list) for ids in data) or not data:
        raise OptionError(f"--expert-map {path}: expected {shape}")
    seen: dict[int, int] = {}
    for rank, ids in enumerate(data):
        for e in ids:
            if not isinstance(e, int) or isinstance(e, bool) or e < 0:
                raise OptionError(f"--expert-map {path}: rank {rank}: {e!r} is not an expert id (a whole number "
                                  f">= 0); expected {shape}")
            if e in seen:
                raise OptionError(f"--expert-map {path}: expert {e} is on rank {seen[e]} and rank {rank}; "
                                  "each expert is hosted by one rank")
            seen[e] = rank
    if world is not None and len(data) != world:
        raise OptionError(f"--expert-map {path}: lists {len(data)} ranks, the job has {world}; one entry per rank")
    return data


def probe_writable(directory: Path) -> str | None:
    """Why no file can be made in `directory` (None: one can). A real create, since permission bits do not
    tell root, read-only mounts or pseudo file systems apart."""
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".distload-probe-"):
            return None
    except OSError as e:
        return e.strerror or str(e)


def check_report_path(report: str | None) -> None:
    if report is None:
        return
    path = Path(report)
    parent = path.absolute().parent
    if path.is_dir():
        raise OptionError(f"--report {report}: is a directory; name a file, e.g. --report {path / 'report.json'}")
    if not parent.is_dir():
        raise OptionError(f"--report {report}: the directory {parent} does not exist; create it or name a file "
                          "in an existing directory")
    why = probe_writable(parent)
    if why:
        raise OptionError(f"--report {report}: cannot write in {parent} ({why}); name a file in a writable directory")


def check_save_path(out: str | None, checkpoint: str) -> None:
    """--save-sharded OUT: not the checkpoint or inside it, not an existing file, in a writable place."""
    if out is None:
        return
    target, source = Path(out).resolve(), Path(checkpoint).resolve()
    if target == source or source in target.parents:
        raise OptionError(f"--save-sharded {out}: is inside the checkpoint {source} being loaded; save elsewhere "
                          "(the save would mix its files with the checkpoint's)")
    if target.exists() and not target.is_dir():
        raise OptionError(f"--save-sharded {out}: exists and is not a directory; name a new or an existing "
                          "save directory")
    existing = next(p for p in (target, *target.parents) if p.exists())
    if not existing.is_dir():
        raise OptionError(f"--save-sharded {out}: {existing} is not a directory; choose another place")
    why = probe_writable(existing)
    if why:
        raise OptionError(f"--save-sharded {out}: cannot write in {existing} ({why}); choose a writable place")


def check_hf_config(directory: str | None) -> None:
    """--hf-config DIR: a directory holding the model's config.json, a JSON object."""
    if directory is None:
        return
    path = Path(directory)
    if not path.is_dir():
        raise OptionError(f"--hf-config {directory}: {'is not a directory' if path.exists() else 'does not exist'}; "
                          "pass the directory that holds the model's config.json")
    config = path / "config.json"
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise OptionError(f"--hf-config {directory}: has no config.json; pass the directory that holds the "
                          "model's config.json") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise OptionError(f"--hf-config {directory}: cannot read config.json as JSON ({e})") from None
    if not isinstance(data, dict):
        raise OptionError(f"--hf-config {directory}: config.json holds a {type(data).__name__}, not a JSON object")


def validate_load_options(path: str, *, timeout_s=600.0, device=None, backend=None, staging_mib=None, tp=None,
                          ep=1, readers="per-node", expert_map_file=None, report=None, save_sharded=None,
                          hf_config=None, world: int | None = None) -> list[list[int]] | None:
    """Every check above, in the order of `distload load --help`; returns the parsed --expert-map (or None)."""
    check_positive("--tp", tp, "2")
    check_positive("--ep", ep, "2")
    check_readers(readers)
    check_device(device)
    check_backend(backend)
    check_timeout(timeout_s)
    check_positive("--staging-mib", staging_mib, "16")
    expert_map = read_expert_map(expert_map_file, world) if expert_map_file else None
    check_save_path(save_sharded, path)
    check_report_path(report)
    check_hf_config(hf_config)
    return expert_map
