"""A torch.distributed.checkpoint directory as a source (checkpoint/dcp.py reads it); config.json from --hf-config."""

from __future__ import annotations

from ..checkpoint.dcp import DcpReader, discover_dcp
from . import missing_config
from .checkpoint import CheckpointSource


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
