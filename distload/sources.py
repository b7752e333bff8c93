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
    report_extra(found, plan)        the report's source-specific fields

Three sources: Hugging Face safetensors / legacy .bin/.pt (`CheckpointSource`), torch.distributed.checkpoint
directories (`DcpSource`, checkpoint/dcp.py) and distload's sharded saves (`sharded/reload.py`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Protocol

from .checkpoint import RangeReader, discover
from .checkpoint.dcp import DcpReader, discover_dcp
from .checkpoint.discover import read_config
from .checkpoint.early_fetch import start_early_fetch
from .checkpoint.legacy import is_legacy_file
from .errors import CheckpointError
from .integrity import checksum_verdict, hash_while_reading, listing_problems
from .plan import DEFAULT_STAGING_BYTES, build_plan
from .mtp import report_fields
from .rules import rules_for
from .transfer.agreement import verdict_everywhere

log = logging.getLogger("distload")


@dataclass(frozen=True)
class Origin:
    """Where a load's bytes come from, as the report, the strategy choice and a --save-sharded record it."""
    root: str
    config: dict
    total_bytes: int
    source: str                        # the source checkpoint a save records
    checkpoint_tensors: dict | None = None   # a save's original tensors (None: the plan's sources)


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
    def report_extra(self, found, plan) -> dict: ...


def missing_config(root) -> CheckpointError:
    return CheckpointError(f"{root}: config.json is missing or empty; distload plans from the model's config "
                           "(architectures, head counts, sizes): put the model's config.json next to the weights, "
                           "or pass --hf-config DIR")


class CheckpointSource:
    """A Hugging Face checkpoint: safetensors (index.json is the authority) or legacy .bin/.pt files."""

    def __init__(self, path: str, options):
        self.path, self.options = path, options
        self.hashing = None          # --verify-checksums: this rank's HashingReader (integrity.py)
        self.checksum_problems: list[str] = []

    def discover(self):
        index = discover(self.path)
        if self.options.hf_config:
            index = replace(index, config=read_config(self.options.hf_config))
        if not index.config:  # every plan needs it (architectures, head counts): say so, not "unknown family"
            raise missing_config(index.root)
        return index

    def early_fetch(self, found, layout):
        # On one node, rank 0 asks storage for the checkpoint's start while the ranks start and plan
        # (checkpoint/early_fetch.py); never around the page cache.
        if not layout.one_node or self.options.read_strategy == "odirect":
            return None
        return start_early_fetch(found, layout.local_world or layout.world, self.options.tuning.early_fetch_bytes)

    def origin(self, found) -> Origin:
        return Origin(str(found.root), found.config, found.total_bytes, str(found.root))

    def plan(self, found, layout, rank: int | None = None):
        options = self.options
        return build_plan(found.tensors, found.config, rules_for(found.config, options.config, options.mtp),
                          layout,
                          strict=options.strict, staging_bytes=options.staging_bytes or DEFAULT_STAGING_BYTES,
                          quantize=options.quantize, dequantize=options.dequantize, rank=rank)

    def before_transfer(self, found, plan, rank: int, clock) -> dict:
        if not self.options.verify_checksums:
            return {}
        readers = plan.layout.readers  # the checksums list is there and names every file; hashed as read
        verdict_everywhere("verify-checksums", lambda: listing_problems(found.root, found.files, readers, rank),
                           lambda by_rank, ranks: checksum_verdict(by_rank, ranks, found.root))
        clock.lap("verify-checksums")
        return {}

    def copy_blocker(self, found, plan) -> str | None:
        if any(is_legacy_file(f) for f in found.files):   # the job's files: a rank's plan lacks other blocks' own
            return "torch.load files are unpickled whole"
        if self.options.verify_checksums:  # direct copies bypass read_into, where the readers hash
            return "--verify-checksums hashes the bytes as the readers read them"
        return None

    def files_reader(self, found, strategy: str, exact: bool):
        return RangeReader(found.root, strategy=strategy, exact=exact)

    def open_reader(self, found, plan, rank: int, strategy: str, exact: bool):
        reader = self.files_reader(found, strategy, exact)
        if not self.options.verify_checksums:
            return reader
        reader, self.hashing = hash_while_reading(reader, found.root, found.files, plan.layout.readers, rank)
        return reader

    def after_transfer(self, reader) -> dict:
        if self.hashing is None:  # before the reader closes: the hashes read what the transfer skipped
            return {}
        self.checksum_problems = self.hashing.finish()
        return {"checksum_files_verified": self.hashing.files_verified()}

    def after_landing(self, found, plan, rank: int, clock) -> dict:
        if not self.options.verify_checksums:
            return {}
        verdict_everywhere("verify-checksums", lambda: self.checksum_problems,
                           lambda by_rank, ranks: checksum_verdict(by_rank, ranks, found.root))
        clock.lap("verify-checksums")
        return {}

    def report_extra(self, found, plan) -> dict:
        rules = rules_for(found.config, self.options.config, self.options.mtp)
        return {"quantization": plan.quantization, "mtp": report_fields(rules, found.config, plan.layout)}


class DcpSource(CheckpointSource):
    """A torch.distributed.checkpoint directory (checkpoint/dcp.py); config.json from --hf-config."""

    def discover(self):
        index = discover_dcp(self.path, self.options.hf_config, self.options.config)
        if not index.config:
            raise missing_config(index.root)
        return index

    def copy_blocker(self, found, plan) -> str | None:
        return "a torch.distributed.checkpoint directory is read chunk by chunk"

    def files_reader(self, found, strategy: str, exact: bool):
        return DcpReader(found, strategy, exact=exact)
