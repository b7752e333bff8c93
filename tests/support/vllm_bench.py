"""vLLM's model load at tp 2 with load_format="distload" against its default loader, cold and warm, in one run.

    python tests/vllm_bench.py OUT_DIR [--layers 10]

Makes (once) a ~1.1 GiB bf16 Llama in OUT_DIR/ckpt, then starts one vLLM instance per (format, cache) in the
order cold distload, warm distload, cold safetensors, warm safetensors; cold evicts the checkpoint's files
from the page cache first (posix_fadvise DONTNEED). Per worker it records the loader's whole load_model time
and the storage bytes it made the worker read (vllm_probe.py); for distload also its report. Prints a table
and writes OUT_DIR/vllm_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from distload.checkpoint import evict_from_page_cache

HERE = Path(__file__).resolve().parent
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
SIZES = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=4,
             vocab_size=32000, max_position_embeddings=2048)


def checkpoint(root: Path, layers: int) -> Path:
    from hf_models import save_checkpoint

    ckpt = root / "ckpt"
    if not (ckpt / "config.json").is_file():
        save_checkpoint("llama", ckpt, dtype=torch.bfloat16, max_shard_size="256MB", num_hidden_layers=layers,
                        **SIZES)
    return ckpt


def one_instance(ckpt: Path, load_format: str, cache: str, root: Path) -> dict:
    if cache == "cold":
        os.sync()  # dirty pages cannot be evicted
        for f in sorted(ckpt.glob("*.safetensors")):
            evict_from_page_cache(f)
    out, report = root / f"{load_format}-{cache}.json", root / f"{load_format}-{cache}-report.json"
    extra = {"report": str(report)} if load_format == "distload" else {}
    cmd = [sys.executable, str(HERE / "vllm_serve.py"), str(ckpt), load_format, str(out), "--extra", json.dumps(extra)]
    proc = subprocess.run(cmd, env={**os.environ, **VLLM_ENV}, cwd=HERE, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise SystemExit(f"vLLM ({load_format}, {cache}) exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    ranks = [r["load"] for r in json.loads(out.read_text())["ranks"]]
    row = {"format": load_format, "cache": cache, "load_s": max(r["seconds"] for r in ranks),
           "storage_read_bytes": sum(r["storage_read_bytes"] for r in ranks), "per_rank": ranks}
    if load_format == "distload":
        rep = json.loads(report.read_text())
        row["distload"] = {k: rep[k] for k in ("storage_bytes_read", "checkpoint_bytes", "seconds", "route")}
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--layers", type=int, default=10)
    args = parser.parse_args()
    root = Path(args.out_dir)
    root.mkdir(parents=True, exist_ok=True)
    ckpt = checkpoint(root, args.layers)
    size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    rows = [one_instance(ckpt, fmt, cache, root) for fmt in ("distload", "safetensors") for cache in ("cold", "warm")]
    (root / "vllm_bench.json").write_text(json.dumps({"checkpoint_bytes": size, "rows": rows}, indent=1))
    print(f"checkpoint {size / 2**30:.2f} GiB, tp 2; load_s: slowest worker's load_model; read: both workers")
    for row in rows:
        print(f"{row['format']:12s} {row['cache']:5s} load_s {row['load_s']:7.2f}  storage read "
              f"{row['storage_read_bytes'] / 2**30:6.2f} GiB")


if __name__ == "__main__":
    main()
