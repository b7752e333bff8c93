"""What differs between loads: the source of the bytes (DESIGN §2 step 2). The pipeline (loader.py) is the
same for every source; a source answers its few questions:

    discover()                       rank 0 only: what is there (an index of tensors, a manifest); the
                                     other ranks get it as metadata and never open a header
    early_fetch(found, layout)       rank 0, before the rendezvous: ask storage for the first bytes
    origin(found)                    root, config.json, bytes, where a --save-sharded of it came from
    plan(found, layout, rank)        the LoadPlan for this job's layout (pure); rank: what that rank's block needs
                                     (None: the whole job)
    before_transfer(found, plan, rank, clock)  collective checks before a byte moves; report fields
    copy_blocker(found, plan)        why its bytes cannot be copied from its files as they are (None: they can)
    open_reader(found, plan, rank, strategy, exact)  the reader of its files
    after_transfer(reader)           inside the transfer phase: report fields (checksums verified)
    after_landing(found, plan, rank, clock)    collective checks once every byte landed; report fields
    report_extra(found, plan, per_rank)  the report's source-specific fields (per_rank: every rank's record)

The sources: Hugging Face safetensors / legacy .bin/.pt in a directory (`checkpoint.py`), safetensors in object
storage (`object_store.py`, s3://), torch.distributed.checkpoint directories (`dcp.py`) and distload's sharded saves
(`sharded/reload.py`); loader.source_for picks one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..errors import CheckpointError


@dataclass(frozen=True)
class Origin:
    """Where a load's bytes come from, as the report, the strategy choice and a --save-sharded record it."""
    root: str
    config: dict
    total_bytes: int
    source: str                        # the source checkpoint a save records
    checkpoint_tensors: dict | None = None   # a save's original tensors (None: the plan's sources)
    local: bool = True                 # on a file system (False: object storage, where no read strategy applies)


class Source(Protocol):
    def discover(self): ...
    def early_fetch(self, found, layout): ...
    def origin(self, found) -> Origin: ...
    def plan(self, found, layout, rank: int | None = None): ...
    def before_transfer(self, found, plan, rank: int, clock) -> dict: ...
    def copy_blocker(self, found, plan) -> str | None: ...
    def open_reader(self, found, plan, rank: int, strategy: str, exact: bool): ...
    def after_transfer(self, reader) -> dict: ...
    def after_landing(self, found, plan, rank: int, clock) -> dict: ...
    def report_extra(self, found, plan, per_rank=()) -> dict: ...


def missing_config(root) -> CheckpointError:
    return CheckpointError(f"{root}: config.json is missing or empty; distload plans from the model's config "
                           "(architectures, head counts, sizes): put the model's config.json next to the weights, "
                           "or pass --hf-config DIR")
