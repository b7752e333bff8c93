"""Scale benchmark: plan published models' real shapes exactly as ONE rank of a cluster job would.

Writes sparse safetensors checkpoints (real headers: the published tensor names, dtypes, shapes and file
count; data regions left as holes, so a 405B checkpoint costs a few MB of disk) and a real config.json,
then, per (model, world) in a fresh subprocess with a time and memory limit, runs what one rank runs
before its first byte moves: discover + rules_for (the "parse" column), build_plan for that rank (the "plan"
column: rank mode, its block's part of the job, as the load plans), plan_digest. The job's buckets and the
node read balance come from the whole job's plan, made after (untimed). Layout: 8 ranks per node, one reader
per node, tp 8, the other ranks data-parallel replicas; MoE models add ep = world / 8 (at most the number
of experts). Prints a markdown table (BENCHMARKS.md, "Scale: planning one rank").

    python scripts/scale_bench.py --models llama3-70b --worlds 8,64 --limit-s 60
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pickle
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from distload import reconcile  # noqa: E402
from distload.checkpoint import discover  # noqa: E402
from distload.errors import DistloadError  # noqa: E402
from distload.inspect_cmd import rank_traffic  # noqa: E402
from distload.plan import build_plan  # noqa: E402
from distload.quant import for_load  # noqa: E402
from distload.rules import rules_for  # noqa: E402
from distload.topology import Layout, reader_ranks  # noqa: E402
from distload.transfer.agreement import plan_digest  # noqa: E402

RANKS_PER_NODE = 8
TP = 8
BF16, F32, FP8 = "BF16", "F32", "F8_E4M3"
ITEMSIZE = {BF16: 2, F32: 4, FP8: 1}


@dataclass(frozen=True)
class ModelShape:
    config: dict
    files: int                    # the published checkpoint's number of safetensors files
    tensors: object               # config -> [(name, dtype, shape)] in the published (state dict) order


def _attention(p: str, c: dict, head_dim: int) -> list:
    h, q, kv = c["hidden_size"], c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    return [(f"{p}.self_attn.q_proj.weight", BF16, (q, h)), (f"{p}.self_attn.k_proj.weight", BF16, (kv, h)),
            (f"{p}.self_attn.v_proj.weight", BF16, (kv, h)), (f"{p}.self_attn.o_proj.weight", BF16, (h, q))]


def _mlp(p: str, hidden: int, inter: int, dtype: str = BF16) -> list:
    return [(f"{p}.gate_proj.weight", dtype, (inter, hidden)), (f"{p}.up_proj.weight", dtype, (inter, hidden)),
            (f"{p}.down_proj.weight", dtype, (hidden, inter))]


def _ends(c: dict, layers: list) -> list:
    h, v = c["hidden_size"], c["vocab_size"]
    return ([("model.embed_tokens.weight", BF16, (v, h))] + layers
            + [("model.norm.weight", BF16, (h,)), ("lm_head.weight", BF16, (v, h))])


def llama_tensors(c: dict) -> list:
    h, layers = c["hidden_size"], []
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        layers += _attention(p, c, h // c["num_attention_heads"]) + _mlp(f"{p}.mlp", h, c["intermediate_size"])
        layers += [(f"{p}.input_layernorm.weight", BF16, (h,)), (f"{p}.post_attention_layernorm.weight", BF16, (h,))]
    return _ends(c, layers)


def qwen3_moe_tensors(c: dict) -> list:
    h, hd, e, layers = c["hidden_size"], c["head_dim"], c["num_experts"], []
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        layers += _attention(p, c, hd) + [(f"{p}.self_attn.q_norm.weight", BF16, (hd,)),
                                          (f"{p}.self_attn.k_norm.weight", BF16, (hd,))]
        layers.append((f"{p}.mlp.gate.weight", BF16, (e, h)))
        for x in range(e):
            layers += _mlp(f"{p}.mlp.experts.{x}", h, c["moe_intermediate_size"])
        layers += [(f"{p}.input_layernorm.weight", BF16, (h,)), (f"{p}.post_attention_layernorm.weight", BF16, (h,))]
    return _ends(c, layers)


def _fp8(name: str, rows: int, cols: int) -> list:
    """A block-FP8 weight and its per-128x128-block scale (DeepSeek-V3's `weight_scale_inv`)."""
    return [(f"{name}.weight", FP8, (rows, cols)), (f"{name}.weight_scale_inv", F32, (-(-rows // 128), -(-cols // 128)))]


def deepseek_v3_tensors(c: dict) -> list:
    h, heads, layers = c["hidden_size"], c["num_attention_heads"], []
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    for i in range(c["num_hidden_layers"]):
        p, a = f"model.layers.{i}", f"model.layers.{i}.self_attn"
        layers += (_fp8(f"{a}.q_a_proj", c["q_lora_rank"], h) + [(f"{a}.q_a_layernorm.weight", BF16, (c["q_lora_rank"],))]
                   + _fp8(f"{a}.q_b_proj", heads * qk, c["q_lora_rank"])
                   + _fp8(f"{a}.kv_a_proj_with_mqa", c["kv_lora_rank"] + c["qk_rope_head_dim"], h)
                   + [(f"{a}.kv_a_layernorm.weight", BF16, (c["kv_lora_rank"],))]
                   + _fp8(f"{a}.kv_b_proj", heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"])
                   + _fp8(f"{a}.o_proj", h, heads * c["v_head_dim"]))
        experts = [f"{p}.mlp.experts.{x}" for x in range(c["n_routed_experts"])] + [f"{p}.mlp.shared_experts"]
        if i < c["first_k_dense_replace"]:
            experts, inter = [f"{p}.mlp"], c["intermediate_size"]
        else:
            inter = c["moe_intermediate_size"]
            layers += [(f"{p}.mlp.gate.weight", BF16, (c["n_routed_experts"], h)),
                       (f"{p}.mlp.gate.e_score_correction_bias", F32, (c["n_routed_experts"],))]
        for x in experts:
            layers += _fp8(f"{x}.gate_proj", inter, h) + _fp8(f"{x}.up_proj", inter, h) + _fp8(f"{x}.down_proj", h, inter)
        layers += [(f"{p}.input_layernorm.weight", BF16, (h,)), (f"{p}.post_attention_layernorm.weight", BF16, (h,))]
    return _ends(c, layers)


_LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", attention_bias=False,
              rms_norm_eps=1e-05, rope_theta=500000.0, tie_word_embeddings=False, torch_dtype="bfloat16",
              bos_token_id=128000, vocab_size=128256)
MODELS = {
    "llama3-70b": ModelShape(dict(_LLAMA, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                                  num_key_value_heads=8, num_hidden_layers=80, max_position_embeddings=8192,
                                  eos_token_id=128001), 30, llama_tensors),
    "llama3.1-405b": ModelShape(dict(_LLAMA, hidden_size=16384, intermediate_size=53248, num_attention_heads=128,
                                     num_key_value_heads=8, num_hidden_layers=126, max_position_embeddings=131072,
                                     eos_token_id=128001, rope_scaling=dict(
                                         factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                         original_max_position_embeddings=8192, rope_type="llama3")),
                                191, llama_tensors),
    "qwen3-235b-a22b": ModelShape(dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=4096, intermediate_size=12288,
        moe_intermediate_size=1536, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
        num_hidden_layers=94, num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[],
        norm_topk_prob=True, max_position_embeddings=40960, rms_norm_eps=1e-06, rope_theta=1000000.0,
        tie_word_embeddings=False, torch_dtype="bfloat16", vocab_size=151936), 118, qwen3_moe_tensors),
    # Planned once a deepseek_v3 family ships (configs/*.toml); until then its row says so.
    "deepseek-v3": ModelShape(dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_attention_heads=128, num_key_value_heads=128, num_hidden_layers=61,
        first_k_dense_replace=3, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        vocab_size=129280, tie_word_embeddings=False, torch_dtype="bfloat16",
        quantization_config=dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                                 weight_block_size=[128, 128])), 163, deepseek_v3_tensors),
    # For the smoke test: the same code path in a second.
    "tiny-llama": ModelShape(dict(_LLAMA, hidden_size=64, intermediate_size=128, num_attention_heads=8,
                                  num_key_value_heads=2, num_hidden_layers=2, vocab_size=256), 2, llama_tensors),
}
DEFAULT_MODELS = ["llama3-70b", "llama3.1-405b", "qwen3-235b-a22b", "deepseek-v3"]


def write_checkpoint(root: Path, shape: ModelShape) -> None:
    """Headers only: each file is its safetensors header, then a hole as long as its tensors' data."""
    tensors = shape.tensors(shape.config)
    sizes = [ITEMSIZE[dt] * _numel(s) for _, dt, s in tensors]
    per_file, total = sum(sizes) / shape.files, sum(sizes)
    groups, acc = [[] for _ in range(shape.files)], 0
    for t, n in zip(tensors, sizes):  # contiguous runs of about equal bytes, as `save_pretrained` shards
        groups[min(shape.files - 1, int(acc / per_file))].append((t, n))
        acc += n
    root.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i, group in enumerate(g for g in groups if g):
        fname = f"model-{i + 1:05d}-of-{shape.files:05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for (name, dt, s), n in group:
            header[name] = {"dtype": dt, "shape": list(s), "data_offsets": [offset, offset + n]}
            weight_map[name] = fname
            offset += n
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        with open(root / fname, "wb") as f:
            f.write(len(blob).to_bytes(8, "little") + blob)
            f.truncate(8 + len(blob) + offset)
    (root / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    (root / "config.json").write_text(json.dumps(shape.config, indent=2))


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def checkpoint_dir(cache: Path, model: str) -> Path:
    """The model's sparse checkpoint under `cache`, written once per shape (a stamp names its config)."""
    shape = MODELS[model]
    stamp = hashlib.sha256(json.dumps([shape.config, shape.files], sort_keys=True).encode()).hexdigest()[:16]
    root = cache / model
    if not (root / f".written-{stamp}").exists():
        write_checkpoint(root, shape)
        (root / f".written-{stamp}").touch()
    return root


def layout_for(model: str, world: int) -> Layout:
    experts = MODELS[model].config.get("num_experts") or MODELS[model].config.get("n_routed_experts")
    ep = min(world // TP, experts) if experts else 1
    local = min(RANKS_PER_NODE, world)
    return Layout(world=world, tp=min(TP, world), ep=max(ep, 1), readers=reader_ranks(world, local, "per-node"),
                  local_world=local)


def rank_messages(plan, rank: int) -> dict:
    """What `rank` posts during the transfer (inspect_cmd.rank_traffic: sends, receives, broadcasts, fan-outs)."""
    return rank_traffic(plan, rank)


def detail_record_bytes(plan, rank: int) -> int:
    """Bytes of this rank's detailed reconciliation record (local_record and its report), as pickled: what
    travels only when something differs (the success path sends reconcile.SUMMARY_BYTES)."""
    specs = plan.specs[rank]
    params = {n: object() for n in specs}
    for n, s in specs.items():
        if s.alias_of:
            params[n] = params[s.alias_of]
    written = {n: [(0, 1 << 62, 0, 1 << 62)] for n in specs}
    record = reconcile.local_record(specs, params, written, lambda ts: [_FakeFingerprint() for _ in ts])
    report = {"rank": rank, "device": "cuda:0", **{k: 1 << 40 for k in ("bytes_read", "bytes_received", "bytes_sent",
              "bytes_from_other_nodes", "peak_rss_bytes", "peak_device_bytes", "io_read_bytes")},
              "files_opened": 191, "transfer_path": "broadcast", "read_strategy": "buffered"}
    return len(pickle.dumps({**record, "report": report}))


class _FakeFingerprint:
    """Stands in for kernels.fingerprint's result (two int64 words) without touching tensor data."""
    def tolist(self):
        return [(1 << 63) - 1, (1 << 63) - 1]


def measure(model: str, world: int, rank: int, cache: Path, quantize: str | None = None) -> dict:
    """One case, in this (fresh) process: planning cost and the plan's per-rank numbers."""
    root = checkpoint_dir(cache, model)
    layout = layout_for(model, world)
    rss0 = _rss_now()
    cpu0 = time.process_time()
    index = discover(root)
    rules = rules_for(index.config)
    cpu_parse = time.process_time() - cpu0
    cpu0 = time.process_time()
    plan = build_plan(index.tensors, index.config, rules, layout, quantization=for_load(index.config, quantize),
                      rank=rank)
    cpu_plan = time.process_time() - cpu0
    peak = max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0)
    cpu0 = time.process_time()
    plan_digest(plan)
    cpu_digest = time.process_time() - cpu0
    traffic = rank_messages(plan, rank)
    record = detail_record_bytes(plan, rank)
    rank_sources, rank_buckets = len(plan.sources), len(plan.buckets)
    if plan.planned_for is not None:
        plan = build_plan(index.tensors, index.config, rules, layout,   # the job's
                          quantization=for_load(index.config, quantize))
    read = {}
    for b in plan.buckets:   # the job waits for its slowest node: its bytes read against the mean
        read[layout.node(b.reader)] = read.get(layout.node(b.reader), 0) + b.read_bytes
    balance = max(read.values()) * len(read) / sum(read.values())
    return dict(balance=balance, tensors=len(index.tensors), parse_s=cpu_parse, plan_s=cpu_plan, peak_mb=peak / 1e6,
                buckets=len(plan.buckets), rank_sources=rank_sources, rank_buckets=rank_buckets,
                p2p=traffic["sends"] + traffic["receives"], bcast=traffic["broadcasts"], fanout=traffic["fanouts"],
                record=record, digest_s=cpu_digest, ep=layout.ep)


def _rss_now() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def run_case(model: str, world: int, args) -> dict | str:
    """measure() in a fresh subprocess: its result, or why there is none ('> limit', '> memory', the error)."""
    cmd = [sys.executable, __file__, "--child", model, str(world), "--rank", str(args.rank), "--cache", str(args.cache)]
    cmd += ["--quantize", args.quantize] if args.quantize else []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + args.limit_s
    while proc.poll() is None:
        if time.monotonic() > deadline or _child_rss_mb(proc.pid) > args.limit_mb:
            why = "> limit" if time.monotonic() > deadline else "> memory"
            proc.kill()
            proc.communicate()
            return why
        time.sleep(0.1)
    out, err = proc.communicate()
    if proc.returncode:
        return "error: " + (err.strip().splitlines() or ["?"])[-1][:160]
    return json.loads(out.strip().splitlines()[-1])


def _child_rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


# "parse s": discover + rules_for (reading the headers and config.json); "plan CPU s": build_plan alone, the
# planning the issue bounds; the peak covers both (RSS high-water mark over the process's start). "rank's
# sources", "rank's buckets": what its node's part of the plan holds; "buckets": the job's.
COLUMNS = ("model", "world", "tensors", "parse s", "plan CPU s", "parse+plan peak MB", "rank's sources", "rank's buckets",
           "buckets", "p2p messages (rank)",
           "broadcasts (rank)", "fan-outs (rank)", "node reads max/mean", "plan_digest CPU s", "detail record B", "reconcile recv/rank B")


def table_row(model: str, world: int, res) -> str:
    # On success every rank receives every rank's fixed-size summary, planned or not.
    received = f"{world * reconcile.SUMMARY_BYTES:,}"
    if isinstance(res, str):
        return f"| {model} | {world} | " + " | ".join([res] + [""] * (len(COLUMNS) - 4) + [received]) + " |"
    cells = [res["tensors"], f"{res['parse_s']:.2f}", f"{res['plan_s']:.2f}", f"{res['peak_mb']:.0f}", res["rank_sources"],
             res["rank_buckets"],
             res["buckets"], res["p2p"],
             res["bcast"], res["fanout"], f"{res['balance']:.2f}", f"{res['digest_s']:.2f}", res["record"], received]
    return f"| {model} | {world}" + (f" (ep {res['ep']})" if res["ep"] > 1 else "") + " | " + \
        " | ".join(f"{c:,}" if isinstance(c, int) else c for c in cells) + " |"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"comma list of {', '.join(MODELS)}")
    ap.add_argument("--worlds", default="8,64,256,1024,4096")
    ap.add_argument("--limit-s", type=float, default=600.0, help="wall seconds per case before '> limit'")
    ap.add_argument("--limit-mb", type=float, default=8192.0, help="RSS per case before '> memory'")
    ap.add_argument("--rank", type=int, default=0, help="the rank that plans")
    ap.add_argument("--cache", type=Path, default=Path("/tmp/distload-scale"), help="where the sparse checkpoints live")
    ap.add_argument("--quantize", default=None, choices=["fp8", "fp8-block"], help="plan with --quantize (online FP8)")
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "WORLD"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child[0], int(args.child[1]), args.rank, args.cache, args.quantize)))
        return 0
    models, worlds = args.models.split(","), [int(w) for w in args.worlds.split(",")]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        ap.error(f"unknown models {unknown}; choose from {', '.join(MODELS)}")
    print(f"Command: `python scripts/scale_bench.py {' '.join(argv if argv is not None else sys.argv[1:])}`\n")
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for model in models:
        try:
            rules_for(MODELS[model].config)
        except DistloadError as exc:
            print(f"| {model} | - | family not shipped: {str(exc)[:90]} |", flush=True)
            continue
        checkpoint_dir(args.cache, model)
        exceeded = None
        for world in sorted(worlds):
            # Planning cost only grows with the world: past the first case over a limit, the rest are too.
            res = f"{exceeded} (at a smaller world)" if exceeded else run_case(model, world, args)
            exceeded = exceeded or (res if isinstance(res, str) and res.startswith(">") else None)
            print(table_row(model, world, res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
