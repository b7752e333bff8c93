"""The base checkpoints every case starts from, made once per corpus run (nothing binary is committed)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/support/hf_models.py, as conftest.py does


def make_bases(root: Path, needed: set[str]) -> dict[str, Path]:
    """demo: distload's demo checkpoint (Llama, 8 heads, bf16, 3 files); llama: 4 heads, 2 kv heads;
    mixtral: 4 experts (both saved by transformers: tests/hf_models.py)."""
    from distload.demo import make_demo_checkpoint

    out = {}
    if "demo" in needed:
        out["demo"] = make_demo_checkpoint(root / "base-demo")
    if needed & {"llama", "mixtral"}:
        from hf_models import save_checkpoint

        for family in sorted(needed & {"llama", "mixtral"}):
            out[family] = save_checkpoint(family, root / f"base-{family}")
    return out
