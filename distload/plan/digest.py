"""The plan's digest: a hash of what planning reads (index, config, rules, layout, options, version).

Every rank must hold the same plan (no control message ever travels). Planning is a pure function of
its inputs, so ranks agree on the plan by agreeing on its inputs: hashing them costs O(tensors) on each
rank, never the size of the plan (which would grow with the job).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json


def _version() -> str:
    """The installed distload's version (ranks running different versions plan differently)."""
    try:
        return importlib.metadata.version("distload")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree: the plan's code is the tree's
        return "source"


def _entries(tensors: dict) -> str:
    """The index as planning sees it: per tensor name, file, offset, dtype and shape, sorted by name."""
    return ";".join(f"{n}|{e.file}|{e.offset}|{e.dtype}|{tuple(e.shape)}" for n, e in sorted(tensors.items()))


def inputs_digest(tensors: dict, config: dict, rules, layout, **options) -> str:
    """Hex digest of a plan's inputs: equal on two ranks iff they plan the same load (same code version)."""
    h = hashlib.sha256()
    for part in (_version(), _entries(tensors), json.dumps(config, sort_keys=True, default=str), repr(rules),
                 repr(layout), repr(sorted(options.items()))):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()
