"""The plan's digest: a hash of what planning reads (index, config, rules, layout, options, version).

Every rank must hold the same plan (no control message ever travels; in rank mode the same job-wide
part, and its block's own part as the block's other ranks). Planning is a pure function of its inputs
(and of the block a rank plans for), so ranks agree on the plan by agreeing on its inputs: hashing them
costs O(tensors) on each rank, never the size of the plan (which would grow with the job).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import io
import json
import pickle


def _version() -> str:
    """The installed distload's version (ranks running different versions plan differently)."""
    try:
        return importlib.metadata.version("distload")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree: the plan's code is the tree's
        return "source"


def _entries(tensors: dict) -> bytes:
    """The index as planning sees it, sorted by name: the names, then per name its file, offset, dtype and
    shape, a column each. Pickled without its memo (fast mode): the bytes depend on the values alone, not on
    which entries share objects, and cost a fraction of a string per tensor."""
    order = sorted(tensors)
    entries = list(map(tensors.__getitem__, order))
    columns = (order, [e.file for e in entries], [e.offset for e in entries], [e.dtype for e in entries],
               [tuple(e.shape) for e in entries])
    out = io.BytesIO()
    pickler = pickle.Pickler(out, protocol=4)
    pickler.fast = True
    pickler.dump(columns)
    return out.getvalue()


def inputs_digest(tensors: dict, config: dict, rules, layout, **options) -> str:
    """Hex digest of a plan's inputs: equal on two ranks iff they plan the same load (same code version)."""
    h = hashlib.sha256()
    for part in (_version(), json.dumps(config, sort_keys=True, default=str), repr(rules), repr(layout),
                 repr(sorted(options.items()))):
        h.update(part.encode())
        h.update(b"\0")
    h.update(_entries(tensors))   # pickle bytes end themselves (STOP): no separator needed
    return h.hexdigest()
