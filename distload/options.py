"""Every load option, once: `LoadOptions` (the flags of `distload load --help`, as keyword arguments) and
`Tuning` (the `DISTLOAD_*` environment variables that change how bytes move, read once when the options
are made and recorded in the report), so no helper reads the environment behind the caller's back.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field

from .errors import DistloadError
from .rules.mtp import check_mode
from .stages import parse_partition
from .validate import check_options

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


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """One load's options (as `distload load --help`); identical on every rank of the job."""
    tp: int | None = None
    pp: int = 1                                # pipeline stages (world = dp x pp x tp)
    pp_layers: tuple[int, ...] | None = None   # layers per stage ("15,15,16,15" or a tuple); None: vLLM's split
    ep: int = 1
    readers: str | int = "per-node"
    config: str | None = None                  # rules file (TOML)
    strict: bool = True
    device: str | None = None
    backend: str | None = None
    timeout_s: float = 600.0
    staging_mib: float | None = None
    read_strategy: str | None = None
    expert_placement: str = "linear"
    expert_map: tuple[tuple[int, ...], ...] | None = None   # EPLB: per rank, the global expert ids it hosts
    save_sharded: str | None = None
    save_for: str | None = None                # "vllm": the save also holds what vLLM's sharded_state reads
    report: str | None = None                  # report JSON file (rank 0)
    progress: bool = True
    reshard: bool = False
    checksums: bool = True                     # a sharded save's sha256 while reading
    hf_config: str | None = None
    quantize: str | None = None
    dequantize: bool = False
    verify_checksums: bool = False
    check_finite: bool = False
    mtp: str = "off"                           # multi-token-prediction layers: off, include (target + draft), only (draft)
    tuning: Tuning = field(default_factory=Tuning.from_environment)

    def __post_init__(self):
        # Checked where they are made, on every rank alike: a bad value is refused before any rendezvous.
        if self.pp is None:   # as tp: None is the default (one stage)
            object.__setattr__(self, "pp", 1)
        if isinstance(self.pp_layers, str):
            object.__setattr__(self, "pp_layers", parse_partition(self.pp_layers))
        check_options(self)
        check_mode(self.mtp)
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


def check_option_names(kwargs: dict) -> None:
    """DistloadError naming each unknown option and the closest known one."""
    unknown = sorted(set(kwargs) - set(OPTION_NAMES))
    if not unknown:
        return
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, OPTION_NAMES, n=1)
        hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise DistloadError(f"unknown load option{'s' if len(unknown) > 1 else ''} {', '.join(hints)}; the options are "
                        f"{', '.join(OPTION_NAMES)}")
