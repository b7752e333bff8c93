"""Options and output paths checked before the rendezvous: a user's mistake is named, with its fix, on
every rank before any process waits for another, instead of surfacing as a traceback from deep inside a
phase (or, for an output path, only after the whole load).

Pure functions of their arguments and the file system; each raises OptionError naming the option.
check_options runs every check of one LoadOptions (its __post_init__ calls it, so the Python API gets the
same checks as the command line); validate_load_options is the one that needs the checkpoint's path.
"""

from __future__ import annotations

import json
import math
import tempfile
from importlib import resources
from pathlib import Path

from .errors import OptionError

BACKENDS = ("gloo", "nccl", "mpi", "ucc")
SAVE_MANIFEST = "manifest.json"  # sharded.manifest.MANIFEST; that module imports torch, which a refusal needs not
DEVICE_TYPES = ("cpu", "cuda")


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


def check_pp_layers(parts, pp: int | None) -> None:
    """None, or one layer count (a whole number >= 1) per pipeline stage; that they sum to the model's layers is
    planning's to check (config.json)."""
    if parts is None:
        return
    shown = ",".join(map(str, parts)) if isinstance(parts, (list, tuple)) else repr(parts)
    if not isinstance(parts, (list, tuple)) or not all(isinstance(n, int) and not isinstance(n, bool) for n in parts):
        raise OptionError(f"--pp-layers {shown}: expected comma-separated layer counts, one per stage, e.g. 15,15,16,15")
    if len(parts) != (pp or 1):
        raise OptionError(f"--pp-layers {shown}: {len(parts)} stages given for --pp {pp or 1}; give one layer count "
                          f"per stage (or --pp {len(parts)})")
    if min(parts, default=0) < 1:
        raise OptionError(f"--pp-layers {shown}: every stage needs at least one layer")


def is_positive_number(value) -> bool:
    """A finite int or float above 0 (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def check_staging_mib(value) -> None:
    """None (the default) or a number of MiB above 0 (a fraction of a MiB makes small buckets for tests)."""
    if value is not None and not is_positive_number(value):
        raise OptionError(f"--staging-mib {value!r}: one staging buffer needs a size in MiB above 0 "
                          "(e.g. --staging-mib 16, the default)")


def check_readers(value) -> None:
    if value in ("per-node", "owners") or (isinstance(value, str) and value.isdigit() and int(value) >= 1):
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


EXPERT_MAP_SHAPE = 'a list per rank of global expert ids, e.g. [[0, 1], [2, 3]], or {"ranks": [[0, 1], [2, 3]]}'


def parse_readers(text: str) -> str | int:
    """--readers on the command line: 'per-node', 'owners' or a number of readers (check_readers checks it)."""
    if text in ("per-node", "owners"):
        return text
    try:
        return int(text)
    except ValueError:
        raise OptionError(f"--readers {text!r}: choose 'per-node', 'owners' (one node only) or a number of "
                          f"readers") from None


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
    if isinstance(data, dict):
        if "ranks" not in data:
            raise OptionError(f"--expert-map {path}: a JSON object needs the key 'ranks' ({EXPERT_MAP_SHAPE})")
        data = data["ranks"]
    if data is None:   # a file given is a map asked for: null is not "no map" (that is leaving --expert-map out)
        raise OptionError(f"--expert-map {path}: holds null where the map should be; expected {EXPERT_MAP_SHAPE} "
                          f"(or leave --expert-map out for the default placement)")
    check_expert_map(data, f"--expert-map {path}")
    if world is not None and len(data) != world:
        raise OptionError(f"--expert-map {path}: lists {len(data)} ranks, the job has {world}; one entry per rank")
    return data


def check_expert_map(data, source: str = "--expert-map") -> None:
    """None, or per rank a list (or tuple) of global expert ids. An id may appear on several ranks: the ranks
    of one expert group share their experts (TP inside the group), and EPLB replicates busy experts; which
    maps fit the model and the layout is planning's to say (plan/experts.py)."""
    if data is None:
        return
    if not isinstance(data, (list, tuple)) or not data:
        raise OptionError(f"{source}: expected {EXPERT_MAP_SHAPE}")
    for rank, ids in enumerate(data):
        if not isinstance(ids, (list, tuple)):
            raise OptionError(f"{source}: rank {rank}: {ids!r} where that rank's list of expert ids should be; "
                              f"expected {EXPERT_MAP_SHAPE}")
        for e in ids:
            if not isinstance(e, int) or isinstance(e, bool) or e < 0:
                raise OptionError(f"{source}: rank {rank}: {e!r} is not an expert id (a whole number >= 0); "
                                  f"expected {EXPERT_MAP_SHAPE}")


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
    """--save-sharded OUT: not the checkpoint or inside it, and a place a save can be written."""
    if out is None:
        return
    target, source = Path(out).resolve(), Path(checkpoint).resolve()
    if target == source or source in target.parents:
        raise OptionError(f"--save-sharded {out}: is inside the checkpoint {source} being loaded; save elsewhere "
                          "(the save would mix its files with the checkpoint's)")
    check_save_target(out)


def check_save_target(out: str | None) -> None:
    """--save-sharded OUT: not an existing file, under a directory this process can write in."""
    if out is None:
        return
    target = Path(out).resolve()
    if target.exists() and not target.is_dir():
        raise OptionError(f"--save-sharded {out}: exists and is not a directory; name a new or an existing "
                          "save directory")
    if target.is_dir() and not (target / SAVE_MANIFEST).is_file() and any(target.iterdir()):
        raise OptionError(f"--save-sharded {out}: the directory exists and is not a distload save (no "
                          f"{SAVE_MANIFEST}); a save replaces its directory: choose another path, or remove it first")
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


def check_max_gbps(value) -> None:
    """None (no cap) or a number of gigabits per second above 0."""
    if value is not None and not is_positive_number(value):
        raise OptionError(f"--max-gbps {value!r}: the job's cap on fetches from the store needs a number of "
                          "gigabits per second above 0 (e.g. --max-gbps 10)")


def check_cache_dir(directory: str | None) -> None:
    """--cache-dir DIR: a directory, or a place one can be made in."""
    if directory is None:
        return
    target = Path(directory).absolute()
    if target.exists() and not target.is_dir():
        raise OptionError(f"--cache-dir {directory}: exists and is not a directory; name a directory for the node "
                          "cache")
    existing = next(p for p in (target, *target.parents) if p.exists())
    why = probe_writable(existing) if existing.is_dir() else "not a directory"
    if why:
        raise OptionError(f"--cache-dir {directory}: cannot write in {existing} ({why}); choose a writable place on "
                          "this node's local disk")


def check_options(options) -> None:
    """Every check of one LoadOptions (duck-typed: options.py imports this module), in the order of
    `distload load --help`; none needs the checkpoint, so each runs where the options are made."""
    check_positive("--tp", options.tp, "2")
    check_positive("--pp", options.pp, "2")
    check_pp_layers(options.pp_layers, options.pp)
    check_positive("--ep", options.ep, "2")
    check_readers(options.readers)
    check_device(options.device)
    check_backend(options.backend)
    check_timeout(options.timeout_s)
    check_staging_mib(options.staging_mib)
    check_expert_map(options.expert_map)
    check_save_target(options.save_sharded)
    check_save_for(options.save_for, options.save_sharded)
    check_report_path(options.report)
    check_hf_config(options.hf_config)
    check_cache_dir(options.cache_dir)
    check_max_gbps(options.max_gbps)


def serving_engines() -> tuple[str, ...]:
    """The engines a save can be for: one naming file each in configs/serving/ (data: no engine is named in code)."""
    folder = resources.files("distload.configs") / "serving"
    return tuple(sorted(p.name[: -len(".toml")] for p in folder.iterdir() if p.name.endswith(".toml")))


def save_for_server(save_for: str) -> tuple[str, str | None]:
    """(engine, version or None) of --for ENGINE[==VERSION]; version "" when the '==' has nothing after it."""
    engine, sep, version = save_for.partition("==")
    return engine, (version if sep else None)


def check_save_for(save_for: str | None, save_sharded: str | None) -> None:
    """--for ENGINE[==VERSION]: an engine distload knows, and only with a --save-sharded to write it into."""
    if save_for is None:
        return
    engine, version = save_for_server(save_for)
    engines = serving_engines()
    if engine not in engines or version == "":
        raise OptionError(f"--for {save_for!r}: distload writes saves for {', '.join(engines)} (optionally "
                          f"ENGINE==VERSION, e.g. vllm==0.32.0); pick one of them")
    if not save_sharded:
        raise OptionError(f"--for {save_for}: says whom a --save-sharded directory is for; add --save-sharded OUT")


OBJECT_URL = "s3://"


def check_source_options(path: str, options) -> None:
    """Options that apply to one kind of checkpoint only (files, or objects), refused by name for the other."""
    if str(path).startswith(OBJECT_URL):
        given = {"--read-strategy": options.read_strategy, "--verify-checksums": options.verify_checksums}
        why = "is about reading files; an s3:// checkpoint is fetched by ranged GETs, each object pinned to its ETag"
    else:
        given = {"--cache-dir": options.cache_dir, "--max-gbps": options.max_gbps}
        why = f"is about fetching from object storage; {path} is not an s3:// URL"
    for flag, value in given.items():
        if value not in (None, False):
            raise OptionError(f"{flag} {why}: drop it")


def validate_load_options(path: str, options) -> None:
    """What check_options (run when `options` were made) cannot know: the save is not inside the checkpoint
    at `path`, and the options fit its kind (files or objects). Run before the rendezvous, so a refusal never
    waits for a peer."""
    check_source_options(path, options)
    if not str(path).startswith(OBJECT_URL):
        check_save_path(options.save_sharded, path)
    else:
        check_save_target(options.save_sharded)
