"""A Hugging Face safetensors checkpoint in object storage (s3://bucket/prefix, checkpoint/s3/): rank 0 lists it and
fetches config, index and headers; the plan is a directory checkpoint's (CheckpointSource.plan); each reader
fetches exactly its ranges, by concurrent ranged GETs pinned to the planned ETags, through the node cache."""

from __future__ import annotations

from dataclasses import replace

from ..checkpoint.discover import read_config
from ..checkpoint.s3.listing import discover_objects
from ..checkpoint.s3.pace import reader_share
from ..checkpoint.s3.reader import ObjectReader
from . import Origin, missing_config
from .checkpoint import CheckpointSource

COUNTS = ("requests", "retries", "bytes_fetched", "bytes_from_cache")


class ObjectStoreSource(CheckpointSource):
    """s3://bucket/prefix: safetensors objects, fetched by ranged GETs (any S3-compatible endpoint)."""

    def discover(self):
        index = discover_objects(self.path, self.options.cache_dir)
        if self.options.hf_config:
            index = replace(index, config=read_config(self.options.hf_config))
        if not index.config:
            raise missing_config(index.root)
        return index

    def early_fetch(self, found, layout):
        return None   # a GET fetches what is read, when it is read: nothing to ask for ahead

    def origin(self, found) -> Origin:
        return Origin(found.root, found.config, found.total_bytes, found.root, local=False)

    def copy_blocker(self, found, plan) -> str | None:
        return "objects in a store are fetched by ranged GETs: there are no files to share"

    def open_reader(self, found, plan, rank: int, strategy: str, exact: bool):
        rate = reader_share(self.options.max_gbps, len(plan.layout.readers))
        return ObjectReader(found, self.options.cache_dir, rate)

    def after_transfer(self, reader) -> dict:
        return {"object_store": reader.stats()} if reader is not None else {}

    def report_extra(self, found, plan, per_rank=()) -> dict:
        """The directory checkpoint's fields, and `object_store`: the job's traffic with the store (rank 0's
        discovery and every reader's fetches), the cap, and the ETag each object was pinned to."""
        ranks = [r["object_store"] for r in per_rank if r.get("object_store")]
        totals = {k: found.discovery.get(k, 0) + sum(r[k] for r in ranks) for k in COUNTS}
        weights = {k: sum(r[k] for r in ranks) for k in ("bytes_fetched", "bytes_from_cache", "bytes_to_cache")}
        return {**super().report_extra(found, plan), "object_store": {
            **totals, "weights": weights, "discovery": found.discovery, "max_gbps": self.options.max_gbps,
            "cache_dir": self.options.cache_dir, "etags": {rel: obj.etag for rel, obj in found.objects.items()}}}
