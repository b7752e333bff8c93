"""Checkpoint access: discover weight files, validate headers, read byte ranges (DESIGN §2 step 2, §5)."""

from .discover import CheckpointIndex, discover
from .header import MAX_HEADER_BYTES, TensorEntry, parse_safetensors_header
from .legacy import LegacyFile, legacy_entries, load_legacy_file
from .file_reads import evict_from_page_cache
from .reader import RangeReader, Reader, ReaderWrapper
from .strategy import STRATEGIES, choose_strategy, usable_cpus

__all__ = [
    "MAX_HEADER_BYTES",
    "STRATEGIES",
    "CheckpointIndex",
    "LegacyFile",
    "RangeReader",
    "Reader",
    "ReaderWrapper",
    "TensorEntry",
    "choose_strategy",
    "discover",
    "evict_from_page_cache",
    "legacy_entries",
    "load_legacy_file",
    "parse_safetensors_header",
    "usable_cpus",
]
