"""Cases: --expert-map files a user (or a tool writing EPLB maps) gets wrong, and maps where none can apply."""

from __future__ import annotations

import json

from .case import Case

MOE = "mixtral"   # 4 experts, 2 layers (tests/hf_models.py)


def _map(content, *options):
    """The map `content` (JSON-able, or text as it is) in eplb.json, loaded by `options` (default --tp 1 --ep 2)."""
    def build(ckpt, ws):
        path = ws / "eplb.json"
        path.write_text(content if isinstance(content, str) else json.dumps(content))
        return [str(ckpt), *(options or ("--tp", "1", "--ep", "2")), "--expert-map", str(path)]
    return build


CASES = [
    Case("map-null", _map("null"), base=MOE, names=("--expert-map", "eplb.json", "null")),
    Case("map-ranks-null", _map({"ranks": None}), base=MOE, names=("--expert-map", "null")),
    Case("map-rank-entry-null", _map([[0, 1], None]), base=MOE, names=("--expert-map", "rank 1", "None")),
    Case("map-ranks-not-list", _map({"ranks": {"0": [0, 1], "1": [2, 3]}}), base=MOE, names=("--expert-map",)),
    Case("map-expert-twice", _map([[0, 1, 1], [2, 3]]), base=MOE, names=("--expert-map", "rank 0", "twice")),
    Case("map-expert-missing", _map([[0, 1], [2]]), base=MOE, names=("--expert-map", "[3]")),
    Case("map-four-ranks-world-2", _map([[0], [1], [2], [3]]), base=MOE, names=("--expert-map", "4", "2")),
    Case("map-expert-negative", _map([[0, 1], [2, -3]]), base=MOE, names=("--expert-map", "rank 1", "-3")),
    Case("map-expert-past-last", _map([[0, 1], [2, 3, 4]]), base=MOE, names=("--expert-map", "[4]", "0..3")),
    Case("map-per-layer-3-layers", _map([[[0, 1], [2, 3]]] * 3), base=MOE, names=("--expert-map", "rank 0")),
    Case("map-float-ids", _map([[0.0, 1.0], [2, 3]]), base=MOE, names=("--expert-map", "0.0")),
    Case("map-bool-id", _map([[True, 1], [2, 3]]), base=MOE, names=("--expert-map", "True")),
    Case("map-non-moe-model", _map([[0, 1], [2, 3]], "--tp", "2"), names=("--expert-map", "experts")),
    Case("map-ep-1", _map([[0, 1], [2, 3]], "--tp", "2", "--ep", "1"), base=MOE,
         names=("--expert-map", "ranks 0 and 1")),
]

EXTRA: list[Case] = []
