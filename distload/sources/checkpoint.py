"""A Hugging Face checkpoint in a directory: safetensors (index.json is the authority) or legacy .bin/.pt files."""

from __future__ import annotations

from dataclasses import replace

from ..checkpoint import RangeReader, discover
from ..checkpoint.discover import read_config
from ..checkpoint.early_fetch import start_early_fetch
from ..checkpoint.integrity import checksum_verdict, hash_while_reading, listing_problems
from ..checkpoint.legacy import is_legacy_file
from ..plan import DEFAULT_STAGING_BYTES, build_plan
from ..quant import for_load
from ..rules import rules_for
from ..rules.mtp import report_fields
from ..transfer.agreement import verdict_everywhere
from . import Origin, missing_config


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
                          quantization=for_load(found.config, options.quantize, options.dequantize), rank=rank)

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

    def report_extra(self, found, plan, per_rank=()) -> dict:
        rules = rules_for(found.config, self.options.config, self.options.mtp)
        return {"quantization": plan.quantization, "mtp": report_fields(rules, found.config, plan.layout)}
