"""Every load option, once: `LoadOptions` (the flags of `distload load --help`, as keyword arguments) and
`Tuning` (the `DISTLOAD_*` environment variables that change how bytes move, read once when the options
are made and recorded in the report), so no helper reads the environment behind the caller's back.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from dataclasses import dataclass, field

from .errors import DistloadError, OptionError
from .rules.mtp import check_mode
from .stages import parse_partition
from .validate import check_options, parse_readers, read_expert_map

EARLY_FETCH_MIB = 128   # what rank 0 asks storage for while the ranks start up (checkpoint/early_fetch.py)


def _flag(env, name: str, default: bool) -> bool:
    text = env.get(name)
    if text is None or text == "":
        return default
    if text in ("0", "1"):
        return text == "1"
    raise DistloadError(f"{name}={text!r}: expected 0 (off) or 1 (on); unset it for the default "
                        f"({int(default)})")


@dataclass(frozen=True, kw_only=True)
class Tuning:
    """How bytes move, where the defaults are right for most machines; from the environment.

    pull: on one node, ranks copy their pieces out of the files their reader opened (DISTLOAD_PULL);
    shm: gloo ranks on a reader's node take pieces from its shared staging (DISTLOAD_SHM);
    hugepages: params in transparent-huge-page memory (DISTLOAD_HUGEPAGES, host_memory.py);
    early_fetch_mib: what rank 0 asks storage for while the ranks start (DISTLOAD_EARLY_FETCH_MIB, 0: off).
    """
    pull: bool = True
    shm: bool = True
    hugepages: bool = False
    early_fetch_mib: float = EARLY_FETCH_MIB

    @classmethod
    def from_environment(cls, env=None) -> Tuning:
        env = os.environ if env is None else env
        text = env.get("DISTLOAD_EARLY_FETCH_MIB", str(EARLY_FETCH_MIB))
        try:
            early = float(text)
        except ValueError:
            raise DistloadError(f"DISTLOAD_EARLY_FETCH_MIB={text!r} is not a number of MiB (0 turns the early "
                                "fetch off)") from None
        return cls(pull=_flag(env, "DISTLOAD_PULL", True), shm=_flag(env, "DISTLOAD_SHM", True),
                   hugepages=_flag(env, "DISTLOAD_HUGEPAGES", False), early_fetch_mib=early)

    @property
    def early_fetch_bytes(self) -> int:
        return int(self.early_fetch_mib * (1 << 20))

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


TUNING_HELP = """tuning (environment, read once at start, recorded in the report's "tuning"):
  DISTLOAD_PULL=0             one node: no pulls from the reader's files (the bucketed transfer instead)
  DISTLOAD_SHM=0              gloo: no shared-memory staging between a reader and its node's ranks
  DISTLOAD_HUGEPAGES=1        params in transparent-huge-page memory
  DISTLOAD_EARLY_FETCH_MIB=N  what rank 0 asks storage for while the ranks start (default 128, 0: off)"""


LOAD, PLAN = "load", "plan"   # an option's scope: load only (load, demo, verify), or also `inspect` (it plans)


def option(default, help: str, *, scope: str = PLAN, flag: str | None = None, engine: bool = False, **cli):
    """One option's declaration, as a dataclass field of LoadOptions: its default, its help line, where it applies
    (`scope`: PLAN options change what is planned and are `inspect`'s too; LOAD ones act only in a load), its
    command-line flag (default `--` + the name with dashes; booleans: `--name` when off by default, `--no-name`
    when on, and then `help` says what the flag does), whether a serving engine's loader config may set it (`engine`: vLLM's model_loader_extra_config),
    and what argparse needs beyond that (`type`, `choices`, `metavar`; `parse`: the command line's value ->
    the option's, e.g. a file read)."""
    return field(default=default, metadata={"help": help, "scope": scope, "flag": flag, "engine": engine, "cli": cli})


def default_tuning() -> Tuning:
    return Tuning.from_environment()


# How readers read (checkpoint/strategy.py chooses one, checkpoint/reader.py implements them); here, with the
# option, so that a command line knows them without importing the readers (and torch).
READ_STRATEGIES = ("plain", "threaded", "threaded-cold", "prefetch", "odirect")


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """One load's options, declared once: `distload load --help`, `distload.load(path, **options)`, `load_into`,
    `inspect` and vLLM's model_loader_extra_config are made from these fields (cli.py, __init__.py,
    engines/vllm.py); identical on every rank of the job."""
    tp: int | None = option(None, "tensor-parallel size (default: the world size)", type=int)
    pp: int = option(1, "pipeline stages (world = dp x pp x tp); each stage gets only its decoder layers", type=int)
    pp_layers: tuple[int, ...] | None = option(
        None, "layers per stage, summing to the model's layers (default: VLLM_PP_LAYER_PARTITION if set, else "
        "vLLM's split)", metavar="A,B,...")
    ep: int = option(1, "expert-parallel size (divides the world size, or one stage's ranks with --pp)", type=int)
    readers: str | int = option(
        "per-node", "'per-node' (local rank 0 of each node reads), N (N readers over the nodes), or 'owners' (one "
        "node: each rank copies its own pieces from the page cache, no second copy)", engine=True, parse=parse_readers)
    config: str | None = option(None, "rules file (TOML) instead of the one chosen from config.json", engine=True)
    strict: bool = option(True, "warn about missing/unexpected instead of failing", flag="--no-strict")
    device: str | None = option(None, "device for params (default cuda:LOCAL_RANK if CUDA, else cpu)")
    backend: str | None = option(None, "process-group backend (default nccl on CUDA, gloo on CPU)", scope=LOAD)
    timeout_s: float = option(600.0, "seconds any collective may wait, and the bound on planning (default 600)",
                              scope=LOAD, flag="--timeout", engine=True, type=float)
    staging_mib: float | None = option(None, "size of one staging buffer (one bucket), MiB (default 16); a reader "
                                       "holds 4", engine=True, type=float)
    read_strategy: str | None = option(
        None, "force a read strategy, one of %(choices)s (default: chosen from the file system, free RAM, the "
        "device and the CPUs per rank; the choice and its reason are logged)", engine=True, metavar="STRATEGY",
        choices=READ_STRATEGIES)
    expert_placement: str = option("linear", "how experts are placed on the expert-parallel ranks",
                                   choices=("linear", "round_robin"))
    expert_map: tuple[tuple[int, ...], ...] | None = option(
        None, "EPLB: per rank, the global expert ids it hosts (the command line: a JSON file)", metavar="FILE",
        parse=read_expert_map)
    save_sharded: str | None = option(None, "write each rank's shards + manifest to OUT", scope=LOAD, metavar="OUT")
    save_for: str | None = option(
        None, "with --save-sharded: OUT also holds what SERVER reads as it is (vllm: load_format='sharded_state', "
        "tp = the world size)", scope=LOAD, flag="--for", metavar="SERVER")
    report: str | None = option(None, "write the report JSON to FILE (rank 0)", scope=LOAD, engine=True,
                                metavar="FILE")
    # progress="log" (no flag): log lines instead of a bar, for an engine's workers, whose output is no terminal
    progress: bool | str = option(True, "no progress bar (default: one on rank 0 when stderr is a terminal)",
                                  scope=LOAD)
    reshard: bool = option(False, "loading a --save-sharded directory saved on another topology: re-cut its shards "
                           "for this job")
    checksums: bool = option(True, "reloading a --save-sharded directory: skip the sha256 check of the bytes read",
                             scope=LOAD, engine=True)
    hf_config: str | None = option(None, "directory with the model's config.json (required for a "
                                   "torch.distributed.checkpoint dir)", metavar="DIR")
    quantize: str | None = option(
        None, "quantize a BF16/FP16 checkpoint's linear weights on each rank as they land: fp8 (one scale per "
        "rank-local param), fp8-block (128x128 blocks) or fp8-channel (one per output row)",
        choices=("fp8", "fp8-block", "fp8-channel"))
    dequantize: bool = option(False, "turn an FP8 or 4-bit checkpoint's weights into BF16")
    verify_checksums: bool = option(
        False, "before the transfer, readers check each weight file's sha256 against CKPT/checksums (sha256sum "
        "output); a --save-sharded directory: its manifest's checksums", scope=LOAD, engine=True)
    check_finite: bool = option(False, "after the transfer, scan every rank's params for NaN/Inf", scope=LOAD,
                                engine=True)
    mtp: str = option(
        "off", "multi-token-prediction (draft) layers of DeepSeek-V3/R1, GLM-4.5: off (default: read not at all), "
        "include (the model and its MTP layers, on the last pipeline stage), only (the draft alone)",
        choices=("off", "include", "only"))
    cache_dir: str | None = option(
        None, "s3:// checkpoints: keep every range fetched in DIR on this node (by object and ETag), and read it from "
        "there in the next load on the node; an object changed on the server is fetched again", scope=LOAD,
        engine=True, metavar="DIR")
    max_gbps: float | None = option(
        None, "s3:// checkpoints: cap the job's fetches from the store at this many gigabits per second, shared "
        "equally by its readers", scope=LOAD, engine=True, type=float, metavar="GBPS")
    tuning: Tuning = field(default_factory=default_tuning)   # the environment's (DISTLOAD_*), not a flag

    def __post_init__(self):
        # Checked where they are made, on every rank alike: a bad value is refused before any rendezvous.
        if self.pp is None:   # as tp: None is the default (one stage)
            object.__setattr__(self, "pp", 1)
        if isinstance(self.pp_layers, str):
            object.__setattr__(self, "pp_layers", parse_partition(self.pp_layers))
        check_options(self)
        check_mode(self.mtp)
        check_kinds(self)
        if self.pp_layers is not None:
            object.__setattr__(self, "pp_layers", tuple(self.pp_layers))
        if self.expert_map is not None:
            object.__setattr__(self, "expert_map", tuple(tuple(ids) for ids in self.expert_map))

    @classmethod
    def from_kwargs(cls, **kwargs) -> LoadOptions:
        """LoadOptions(**kwargs), refusing a misspelt name by name (with the closest option)."""
        check_option_names(kwargs)
        return cls(**kwargs)

    def replace(self, **changes) -> LoadOptions:
        check_option_names(changes)
        return dataclasses.replace(self, **changes)

    @property
    def staging_bytes(self) -> int | None:
        """One staging buffer's bytes (None: the plan's default); a fraction of a MiB makes small tests."""
        return int(self.staging_mib * (1 << 20)) if self.staging_mib else None


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(LoadOptions))
PROGRESS_VALUES = (True, False, "log")


def check_kinds(options: LoadOptions) -> None:
    """What argparse checks on the command line, for the Python API and engines' configs too: an option with
    choices takes one of them, a switch is True or False (`progress` also "log")."""
    for f in declared():
        value, choices = getattr(options, f.name), f.metadata["cli"].get("choices")
        if choices and value not in choices and not (value is None and f.default is None):
            raise OptionError(f"{flag_of(f)} {value!r}: choose one of {', '.join(choices)}")
        allowed = PROGRESS_VALUES if f.name == "progress" else (True, False)
        if isinstance(f.default, bool) and not any(value is v if isinstance(v, bool) else value == v
                                                   for v in allowed):
            raise OptionError(f"{flag_of(f)} {value!r}: a switch, True or False"
                              + (" (or 'log': log lines instead of a bar)" if f.name == "progress" else ""))


def declared(scope: str | None = None, engine: bool = False) -> tuple[dataclasses.Field, ...]:
    """The declared options (LoadOptions' fields with a declaration; not `tuning`): all, those of one scope
    (PLAN: what `inspect` takes too), or those an engine's loader config may set."""
    fields = [f for f in dataclasses.fields(LoadOptions) if "help" in f.metadata]
    if scope == PLAN:
        fields = [f for f in fields if f.metadata["scope"] == PLAN]
    if engine:
        fields = [f for f in fields if f.metadata["engine"]]
    return tuple(fields)


def flag_of(f: dataclasses.Field) -> str:
    """The command-line flag of a declared option."""
    if f.metadata["flag"]:
        return f.metadata["flag"]
    name = f.name.replace("_", "-")
    return f"--no-{name}" if f.default is True else f"--{name}"


def as_config_keys(message: str) -> str:
    """An option error in the words of an engine's loader config, which names options by key: `"readers": 'x'`
    where the command line says `--readers 'x'`."""
    for f in declared(engine=True):
        message = re.sub(rf"(?<![\w-]){re.escape(flag_of(f))}(?![\w-])", f'"{f.name}":', message)
    return message


def check_option_names(kwargs: dict, scope: str | None = None) -> None:
    """DistloadError naming each unknown option and the closest known one; with scope=PLAN (inspect) also each
    option that only a load uses."""
    known = OPTION_NAMES if scope is None else tuple(f.name for f in declared(scope)) + ("tuning",)
    unknown = sorted(set(kwargs) - set(known))
    if not unknown:
        return
    load_only = [name for name in unknown if name in OPTION_NAMES]
    if load_only:
        raise DistloadError(f"{', '.join(map(repr, load_only))}: option{'s' if len(load_only) > 1 else ''} of a load, "
                            f"not of planning (inspect plans a load and writes nothing); drop "
                            f"{'them' if len(load_only) > 1 else 'it'}")
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=1)
        hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise DistloadError(f"unknown load option{'s' if len(unknown) > 1 else ''} {', '.join(hints)}; the options are "
                        f"{', '.join(known)}")
