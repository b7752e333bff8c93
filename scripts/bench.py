"""Side-by-side load benchmark: distload against the loaders people use today, in the same run.

    python scripts/bench.py                      # ~1 GiB Llama-shaped bf16 checkpoint, 1/2/4 ranks + 2 emulated nodes
    python scripts/bench.py --quick              # a few MB, world 2, one repetition (the smoke test)
    python scripts/bench.py --checkpoint DIR     # benchmark an existing Llama-family checkpoint
    python scripts/bench.py --publish            # also rewrite BENCHMARKS.md and benchmarks/ with the results
    python scripts/bench.py --device cuda        # 1 rank, params on the GPU (NCCL), with storage and H2D GB/s

Every scenario (world size, one node or two emulated nodes) is one `torchrun` job whose ranks run every
loader, cold and warm, alternating, `--reps` times; the median is reported. Loaders, each filling the same
preallocated serving-layout params (vLLM's names and shards) on every rank:

- distload:        this project (`readers` per node; on two nodes also with a single reader);
- distload-owners: this project with `--readers owners` (one node only): every rank copies its own pieces
                   from the page cache (distload/owner_reads.py);
- every-rank-reads: vLLM's default loader: each rank `safe_open`s every file and copies its own slices
                   (`get_slice`) into its params (vLLM 0.32's iterator `get_tensor`s every tensor whole, so
                   this baseline reads less than vLLM under TP; under --pp it reads other stages' tensors whole,
                   as vLLM does; under EP vLLM skips other ranks' expert weights before reading
                   (ep_weight_filter.py): the checkpoints here are dense, an MoE run must skip them too);
- fastsafetensors: its distributed loader as vLLM drives it: files spread over the ranks, each rank reads
                   whole files, `get_sharded` scatters the shards over the same process group;
- dcp:             `torch.distributed.checkpoint.load` with its `HuggingFaceStorageReader` into DTensors
                   that view the params (each rank reads its own slices).

Cold runs evict the checkpoint from the page cache first (`posix_fadvise(DONTNEED)`, per node); warm runs
read it into the page cache first. Two emulated nodes are two torchrun node agents on this machine, each in
its own mount namespace where its own copy of the checkpoint is bind-mounted at one path, so that each
"node" has its own page cache, as on a cluster (needs root for `unshare -m`; skipped otherwise).

Metrics per row: median load seconds (slowest rank, from a barrier to its params being filled), bytes read
from the block device (`/proc/diskstats`, the whole machine) and by the ranks (`/proc/self/io` read_bytes),
bytes received per rank over the process group, peak RSS per rank (VmHWM, reset before each run). Every
loader's params are fingerprinted on the first repetition and must agree bit for bit across loaders.
Outputs: OUT/results.json, OUT/results.md, OUT/bench.png.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import math
import os
import platform
import random
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

from distload.checkpoint import STRATEGIES as READ_STRATEGIES  # noqa: E402  (distload-<strategy> loaders)

# A Llama-2/TinyLlama-shaped decoder; the layer count is chosen to hit the requested size.
LLAMA_SHAPE = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632,
    "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 32000, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "max_position_embeddings": 2048, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "hidden_act": "silu",
}
# --quick: a few MB, same structure (tp 1, 2, 4 divide every head count and size).
QUICK_SHAPE = {**LLAMA_SHAPE, "hidden_size": 256, "intermediate_size": 704, "num_attention_heads": 8,
               "num_key_value_heads": 4, "vocab_size": 2000}

LOADERS = ("distload", "distload-owners", "distload-1reader", "every-rank-reads", "fastsafetensors", "dcp")
ONE_NODE_ONLY = ("distload-owners",)  # refused across nodes (it would read a tensor once per node)
TWO_NODES_ONLY = ("distload-1reader",)
# Not in the default set: distload with every rank a reader (each byte still read once: the readers split
# the checkpoint), distload with its same-node shared memory turned off, distload with huge-page params
# (DISTLOAD_HUGEPAGES=1, see distload/transfer/host_memory.py), the baseline filling huge-page params too (what
# that allocation alone changes), distload without its early fetch of the checkpoint's start on one node
# (DISTLOAD_EARLY_FETCH_MIB=0, see distload/checkpoint/early_fetch.py), and distload with each
# `--read-strategy` forced (distload-plain, distload-threaded, ...: what the automatic choice, logged per
# load, gains or loses).
EXTRA_LOADERS = ("distload-all-readers", "distload-noshm", "distload-thp", "distload-no-early-fetch",
                 "every-rank-reads-thp",
                 *(f"distload-{s}" for s in READ_STRATEGIES))
BASELINE = "every-rank-reads"


# ----------------------------------------------------------------------------------------------------
# The checkpoint


def llama_tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Tensor names and shapes in the order Hugging Face saves a Llama (embedding, layers, norm, head)."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    out = [("model.embed_tokens.weight", (v, h))]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
                (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i)),
                (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    return out


def llama_config_for(size_bytes: int, quick: bool = False) -> dict:
    cfg = dict(QUICK_SHAPE if quick else LLAMA_SHAPE)

    def nbytes(layers):
        return sum(math.prod(s) for _, s in llama_tensor_shapes({**cfg, "num_hidden_layers": layers})) * 2

    per_layer = nbytes(2) - nbytes(1)
    cfg["num_hidden_layers"] = max(1, round((size_bytes - (nbytes(1) - per_layer)) / per_layer))
    return cfg


def make_checkpoint(path: Path, size_bytes: int, files: int = 4, quick: bool = False, seed: int = 0) -> Path:
    """Write a random bf16 Llama-shaped checkpoint: `files` safetensors files + index + config.json."""
    import torch
    from safetensors.torch import save_file

    if (path / "model.safetensors.index.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    cfg = llama_config_for(size_bytes, quick)
    shapes = llama_tensor_shapes(cfg)
    total = sum(math.prod(s) for _, s in shapes) * 2
    gen = torch.Generator().manual_seed(seed)
    weight_map, written, k, part = {}, 0, 0, {}

    def flush():
        nonlocal part, k
        if part:
            name = f"model-{k + 1:05d}-of-{files:05d}.safetensors"
            save_file(part, str(path / f".{name}.tmp"), metadata={"format": "pt"})
            (path / f".{name}.tmp").rename(path / name)
            weight_map.update({n: name for n in part})
            part, k = {}, k + 1

    for name, shape in shapes:
        if part and written >= total * (k + 1) / files and k < files - 1:
            flush()
        t = torch.randn(shape, generator=gen, dtype=torch.float32).mul_(0.02).to(torch.bfloat16)
        if len(shape) == 1:
            t += 1
        part[name] = t
        written += t.numel() * 2
    flush()
    if k < files:  # fewer tensors than files asked for: name the files by what was written
        for i in range(k):
            old, new = f"model-{i + 1:05d}-of-{files:05d}.safetensors", f"model-{i + 1:05d}-of-{k:05d}.safetensors"
            (path / old).rename(path / new)
            weight_map = {n: (new if f == old else f) for n, f in weight_map.items()}
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    os.sync()  # dirty pages cannot be evicted: a cold run must find the files on disk
    return path


def weight_files(ckpt: Path) -> list[str]:
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    return sorted(set(index["weight_map"].values()))


# ----------------------------------------------------------------------------------------------------
# Measuring a process and the machine


def block_device_of(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return os.major(st.st_dev), os.minor(st.st_dev)


def disk_read_bytes(device: tuple[int, int]) -> int | None:
    """Bytes read from the block device so far (/proc/diskstats sectors read x 512), whole machine."""
    try:
        for line in Path("/proc/diskstats").read_text().splitlines():
            f = line.split()
            if (int(f[0]), int(f[1])) == device:
                return int(f[5]) * 512
    except OSError:
        pass
    return None


def node_counters() -> dict:
    """This node's storage and link byte counters, where an emulated cluster (scripts/cluster.py) names them:
    DISTLOAD_BENCH_DISK = "COUNTER_FILE MAJ:MIN" (a blkio cgroup's io_service_bytes), DISTLOAD_BENCH_NIC = the
    node's interface (its bytes sent and received, L2)."""
    out = {}
    if disk := os.environ.get("DISTLOAD_BENCH_DISK"):
        counter, dev = disk.rsplit(" ", 1)
        for line in Path(counter).read_text().splitlines():
            f = line.split()
            if len(f) == 3 and f[0] == dev and f[1] == "Read":
                out["storage_bytes"] = int(f[2])
    if nic := os.environ.get("DISTLOAD_BENCH_NIC"):
        stats = Path("/sys/class/net") / nic / "statistics"
        out["sent_bytes"] = int((stats / "tx_bytes").read_text())
        out["received_bytes"] = int((stats / "rx_bytes").read_text())
    return out


def proc_read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    return 0


def peak_rss_bytes() -> int:
    return _status_bytes("VmHWM:")


def rss_bytes() -> int:
    return _status_bytes("VmRSS:")


def reset_peak_rss() -> None:
    """Give freed memory back to the OS and restart the high-water mark at the current RSS."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def evict(ckpt: Path, files: list[str]) -> None:
    from distload.checkpoint import evict_from_page_cache

    for f in files:
        evict_from_page_cache(ckpt / f)


def bandwidth_probes(ckpt: Path, files: list[str], device: str) -> dict:
    """What the hardware gives, to set the loaders' GB/s against: the checkpoint read cold by one process in
    16 MiB `readinto`s (storage), and, on CUDA, a 256 MiB pinned host buffer copied to the device (H2D)."""
    import torch

    evict(ckpt, files)
    buf, total = bytearray(16 << 20), 0
    t0 = time.perf_counter()
    for f in files:
        with open(ckpt / f, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                total += n
    out = {"storage_read_gbps": total / (time.perf_counter() - t0) / 1e9, "device": device}
    if device.startswith("cuda"):
        host = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty_like(host, device=device)
        dev.copy_(host)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        out["h2d_pinned_gbps"] = 5 * host.numel() / (time.perf_counter() - t0) / 1e9
        out["device_name"] = torch.cuda.get_device_name(device)
    return out


def warm_up(ckpt: Path, files: list[str]) -> None:
    buf = bytearray(16 << 20)
    for f in files:
        with open(ckpt / f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


# ----------------------------------------------------------------------------------------------------
# The loaders (worker side). Each returns (params, bytes this rank received over the process group).


class Context:
    def __init__(self, ckpt: Path, staging_mib: int | None, loaders: list[str], device: str = "cpu",
                 tp: int | None = None, pp: int = 1):
        import torch.distributed as dist

        import distload

        self.ckpt, self.staging_mib, self.device = ckpt, staging_mib, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.pp = pp  # pipeline stages: a rank holds only its stage's layers
        self.tp = tp or self.world // pp  # ranks beyond tp x pp: data-parallel replicas holding the same shards
        self.local_world = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        self.files = weight_files(ckpt)
        # The serving layout every loader must produce: distload's plan (a pure function), made here, outside
        # the timed region of the other loaders.
        self.plan = distload.inspect(ckpt, tp=self.tp, pp=pp, world=self.world, local_world=self.local_world)
        self.mine: dict[str, list] = {}
        for name, src in self.plan.sources.items():
            for d in src.deliveries:
                if d.rank == self.rank:
                    self.mine.setdefault(name, []).append((d.param, d.piece))
        self.file_tensors = {f: [] for f in self.files}
        index = json.loads((ckpt / "model.safetensors.index.json").read_text())
        for name, f in index["weight_map"].items():
            self.file_tensors[f].append(name)
        for f in self.files:
            self.file_tensors[f].sort(key=lambda n: self.plan.sources[n].offset if n in self.plan.sources else 0)
        # Imports and set-up are not load time, for any loader.
        self.mesh, self.phases = None, None   # phases: the last distload load's seconds per phase (its report)
        if "dcp" in loaders:
            import torch.distributed.checkpoint  # noqa: F401
            from torch.distributed.tensor import DTensor  # noqa: F401

            if self.world > 1:  # DCP's DTensors need a device mesh
                from torch.distributed.device_mesh import init_device_mesh

                self.mesh = init_device_mesh("cpu", (self.world,))
        if "fastsafetensors" in loaders:
            import fastsafetensors  # noqa: F401

    def allocate(self, huge_pages: bool = False):
        """The params the other loaders fill: `torch.empty` per param, as a model's constructor makes them
        (vLLM's loaders fill the module the model built). huge_pages: in transparent huge pages, as distload
        allocates with DISTLOAD_HUGEPAGES=1 (distload/transfer/host_memory.py), to show what that alone changes."""
        from distload.loader import allocate
        from distload.transfer import TransferStats, zero_padding

        specs = self.plan.specs[self.rank]
        params = allocate(specs, self.device, huge=huge_pages)
        # Padded vocab rows (e.g. vocab 2000 at tp 2: rank 1 holds 976 rows and 48 of padding) are zeros in the
        # serving layout; vLLM's loader zero-fills them too. Left as torch.empty made them, they held whatever
        # memory the allocator reused, and the byte comparison with distload failed now and then (CI, --quick).
        zero_padding(params, specs, TransferStats())
        return params

    def region(self, params, param, piece):
        """The piece's destination in the param (a 2-D view)."""
        from distload.plan.shard import view2d

        t = params[param]
        rows, cols = piece.rows[1] - piece.rows[0], piece.cols[1] - piece.cols[0]
        return t.view(view2d(tuple(t.shape)))[piece.dst_row:piece.dst_row + rows, piece.dst_col:piece.dst_col + cols]

    def even_split_dim(self, name: str) -> int | None:
        """The dim along which every rank's piece is its `ceil(n / world)` block (the split fastsafetensors and
        DTensor make), -1 if every rank takes the whole tensor, None if the serving layout is another split
        (a padded vocab, replicated kv heads): then those loaders must fetch the whole tensor and cut it."""
        from distload.plan.shard import view2d

        src = self.plan.sources[name]
        full = view2d(src.shape)
        by_rank = {}
        for d in src.deliveries:
            by_rank.setdefault(d.rank, []).append(d.piece)
        if sorted(by_rank) != list(range(self.world)) or any(len(ps) != 1 for ps in by_rank.values()):
            return None
        pieces = [by_rank[r][0] for r in range(self.world)]
        if all(p.rows == (0, full[0]) and p.cols == (0, full[1]) for p in pieces):
            return -1
        for dim, span in ((0, "rows"), (1, "cols")):
            n = full[dim]
            block = -(-n // self.world)
            want = [(min(r * block, n), min((r + 1) * block, n)) for r in range(self.world)]
            other = (0, full[1 - dim])
            if all(getattr(p, span) == w and getattr(p, "cols" if dim == 0 else "rows") == other
                   for p, w in zip(pieces, want)):
                return dim if len(src.shape) > 1 or dim == 0 else None
        return None


def load_distload(ctx: Context, readers, read_strategy: str | None = None):
    import distload

    result = distload.load(ctx.ckpt, tp=ctx.tp, pp=ctx.pp, readers=readers, staging_mib=ctx.staging_mib, progress=False,
                           device=ctx.device, read_strategy=read_strategy)
    # this rank's, for the run's record: each phase's own seconds, and what it waited for the others
    waiting = result.report.get("waiting", {})   # (absent from older distload's reports)
    ctx.phases = {**result.report["seconds"], **{f"waiting {k}": v for k, v in waiting.items()}}
    return result.params, result.report["per_rank"][ctx.rank]["bytes_received"]


def load_every_rank_reads(ctx: Context, huge_pages: bool = False):
    """vLLM's DefaultModelLoader on every rank: open every file, copy this rank's slices into its params."""
    from safetensors import safe_open

    params = ctx.allocate(huge_pages)
    for f in ctx.files:
        with safe_open(str(ctx.ckpt / f), framework="pt") as fh:
            for name in fh.keys():
                if ctx.pp > 1 and name not in ctx.mine:
                    fh.get_tensor(name)  # vLLM's iterator reads every tensor; the model skips other stages'
                for param, piece in ctx.mine.get(name, ()):
                    rows = slice(*piece.rows)
                    sl = fh.get_slice(name)
                    t = sl[rows] if len(sl.get_shape()) == 1 else sl[rows, slice(*piece.cols)]
                    dst = ctx.region(params, param, piece)
                    dst.copy_(t.reshape(dst.shape))  # safetensors slices may be views of the mmap: copy
    return params, 0


def load_fastsafetensors(ctx: Context):
    """fastsafetensors as vLLM drives it: `world` files at a time, one per rank, then get_sharded per tensor."""
    import torch.distributed as dist
    from fastsafetensors import SafeTensorsFileLoader

    params = ctx.allocate()
    received = 0
    loader = SafeTensorsFileLoader(dist.group.WORLD, ctx.device, nogds=True)
    try:
        for at in range(0, len(ctx.files), ctx.world):
            batch = ctx.files[at:at + ctx.world]
            owner = {f: r for r, f in enumerate(batch)}
            loader.add_filenames({r: [str(ctx.ckpt / f)] for r, f in enumerate(batch)})
            buffers = loader.copy_files_to_device()
            try:
                for f in batch:
                    for name in ctx.file_tensors[f]:
                        dim = ctx.even_split_dim(name)
                        # Every rank calls the same collective for every tensor, in the same order.
                        t = buffers.get_sharded(name, dim) if dim is not None else buffers.get_tensor(name)
                        if owner[f] != ctx.rank:
                            received += t.numel() * t.element_size()
                        for param, piece in ctx.mine.get(name, ()):
                            dst = ctx.region(params, param, piece)
                            if dim is None:  # the whole tensor came: cut this rank's piece
                                t2 = t.reshape(-1, dst.shape[1]) if t.dim() > 1 else t.reshape(-1, 1)
                                dst.copy_(t2[slice(*piece.rows), slice(*piece.cols)])
                            else:
                                dst.copy_(t.reshape(dst.shape))
            finally:
                buffers.close()
            loader.reset()
    finally:
        loader.close()
    return params, received


def load_dcp(ctx: Context):
    """torch.distributed.checkpoint.load with the Hugging Face storage reader, into DTensor views of the params."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.tensor import DTensor, Shard

    from distload.checkpoint.dcp import contiguous_strides

    if ctx.device != "cpu":
        raise NotImplementedError("dcp is compared on CPU only")
    params = ctx.allocate()
    state, cut_after = {}, []
    for name, places in ctx.mine.items():
        src = ctx.plan.sources[name]
        dim = ctx.even_split_dim(name)
        if dim is None:  # DTensor cannot express this split: load the whole tensor, then cut the pieces
            import torch

            state[name] = whole = torch.empty(src.shape, dtype=params[places[0][0]].dtype)
            cut_after.append((whole, places))
            continue
        (param, piece), = places
        view = ctx.region(params, param, piece)
        if len(src.shape) == 1:
            view = view.reshape(-1)
        if dim < 0 or ctx.world == 1:
            state[name] = view
        else:
            state[name] = DTensor.from_local(view, ctx.mesh, [Shard(dim)], run_check=False,
                                             shape=tuple(src.shape), stride=contiguous_strides(src.shape))
    dcp.load(state, storage_reader=HuggingFaceStorageReader(str(ctx.ckpt)))
    for whole, places in cut_after:
        w2 = whole.reshape(whole.shape[0], -1) if whole.dim() > 1 else whole.reshape(-1, 1)
        for param, piece in places:
            ctx.region(params, param, piece).copy_(w2[slice(*piece.rows), slice(*piece.cols)])
    return params, 0


def run_loader(ctx: Context, loader: str):
    if loader == "distload":
        return load_distload(ctx, "per-node")
    if loader == "distload-1reader":
        return load_distload(ctx, 1)
    if loader == "distload-all-readers":
        return load_distload(ctx, ctx.world)
    if loader == "distload-owners":
        return load_distload(ctx, "owners")
    forced = loader.removeprefix("distload-")
    if forced in READ_STRATEGIES:
        return load_distload(ctx, "per-node", read_strategy=forced)
    switched = {"distload-noshm": ("DISTLOAD_SHM", "0"), "distload-thp": ("DISTLOAD_HUGEPAGES", "1"),
                "distload-no-early-fetch": ("DISTLOAD_EARLY_FETCH_MIB", "0")}
    if loader in switched:
        name, value = switched[loader]
        os.environ[name] = value
        try:
            return load_distload(ctx, "per-node")
        finally:
            del os.environ[name]
    if loader == BASELINE:
        return load_every_rank_reads(ctx)
    if loader == "every-rank-reads-thp":
        return load_every_rank_reads(ctx, huge_pages=True)
    if loader == "fastsafetensors":
        return load_fastsafetensors(ctx)
    if loader == "dcp":
        return load_dcp(ctx)
    raise ValueError(loader)


def fingerprint(params) -> int:
    """CRC-32 of this rank's params, name by name (equal across loaders iff names, shapes and bytes are)."""
    import zlib

    import torch

    crc = 0
    for name in sorted(params):
        t = params[name].detach().contiguous().cpu()
        crc = zlib.crc32(f"{name}{list(t.shape)}".encode(), crc)
        crc = zlib.crc32(memoryview(t.view(-1).view(torch.uint8).numpy()), crc)
    return crc


# ----------------------------------------------------------------------------------------------------
# The worker: one torchrun job, every loader, cold and warm, alternating


def worker(args) -> int:
    import torch
    import torch.distributed as dist

    # Before the group exists: importing it afterwards pins the group in torch.distributed.nn's default
    # arguments and the process can abort at exit (topology.init_process_group says why).
    import torch.distributed.nn.functional  # noqa: F401

    logging_quiet()
    torch.set_num_threads(1)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    on_cuda = args.device == "cuda"
    if on_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if on_cuda else "gloo", timeout=datetime.timedelta(minutes=20))
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = Path(args.checkpoint)
    loaders = args.loaders.split(",")
    ctx = Context(ckpt, args.staging_mib, loaders, f"cuda:{local_rank}" if on_cuda else "cpu", args.tp, args.pp)

    def finished() -> float:  # device copies are asynchronous: a load ends when they are done
        if on_cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    if rank == 0 and args.probes:
        nodes = world // ctx.local_world
        probes = {**bandwidth_probes(ckpt, ctx.files, ctx.device), "world": world, "nodes": nodes}
        Path(args.jsonl).with_name(f"probes-w{world}-n{nodes}.json").write_text(json.dumps(probes))
    device = block_device_of(ckpt / ctx.files[0])
    out = open(args.jsonl, "a") if rank == 0 else None
    shard_bytes = sum(s.nbytes for s in ctx.plan.specs[rank].values() if not s.alias_of)
    reset_peak_rss()
    # What a fresh process holds before it loads anything (interpreter, torch, every loader's imports, the
    # process group). Runs here share one process, so a run's peak RSS is reported as this plus what the run
    # added (VmHWM during it minus VmRSS before it): memory another loader left behind is not charged to it.
    interpreter_rss = rss_bytes()
    if args.warmup:
        # One untimed load per loader first: what runs once per process (imports inside functions, lazily
        # built caches, connection setup) is not load time for any of them. On shaped links a load of the
        # benchmark's checkpoint takes minutes: there a small one of the same structure warms up instead.
        warm_ctx = Context(Path(args.warmup_checkpoint), args.staging_mib, loaders, ctx.device, args.tp, args.pp) \
            if args.warmup_checkpoint else ctx
        for loader in loaders:
            try:
                params, _ = run_loader(warm_ctx, loader)
                del params
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException:  # reported by the timed runs
                pass
            dist.barrier()
    for rep in range(args.reps):
        # A new order every repetition (seeded: the same on every rank): no loader always goes first or always
        # follows the same one. With a fixed rotation, distload's 1-rank cold run always followed DCP's warm run
        # and took 0.6-1.8 s where the same code path took 0.58 s after another loader: what ran before
        # changes a run's cost on this VM (memory state), so it must not be the same loader every time.
        order = list(loaders)
        random.Random(rep).shuffle(order)
        for loader in order:
            for cache in args.caches.split(","):
                if local_rank == 0:  # one process per node prepares that node's page cache
                    (evict if cache == "cold" else warm_up)(ckpt, ctx.files)
                reset_peak_rss()
                rss0 = rss_bytes()
                dist.barrier()
                disk0 = disk_read_bytes(device) if rank == 0 else None
                node0 = node_counters() if local_rank == 0 else None
                io0, cpu0 = proc_read_bytes(), cpu_seconds()
                dist.barrier()
                t0, started_at = time.perf_counter(), time.time()
                error, ctx.phases = None, None
                try:
                    params, received = run_loader(ctx, loader)
                except (KeyboardInterrupt, SystemExit):
                    raise
                except BaseException as exc:  # a loader that cannot run here is reported, not fatal
                    params, received, error = {}, 0, f"{type(exc).__name__}: {exc}"
                seconds = finished() - t0
                cpu = cpu_seconds() - cpu0
                io = proc_read_bytes() - io0
                dist.barrier()
                disk = disk_read_bytes(device) - disk0 if rank == 0 and disk0 is not None else None
                node = {k: v - node0[k] for k, v in node_counters().items()} if node0 is not None else None
                record = {"rank": rank, "seconds": seconds, "cpu_seconds": cpu, "io_read_bytes": io, "node": node,
                          "peak_rss_bytes": interpreter_rss + max(0, peak_rss_bytes() - rss0),
                          "vmhwm_bytes": peak_rss_bytes(), "rss_before_bytes": rss0, "bytes_received": int(received),
                          "shard_bytes": shard_bytes, "error": error, "phases": ctx.phases,
                          "fingerprint": fingerprint(params) if rep == 0 and error is None else None}
                del params
                per_rank = [None] * world
                dist.all_gather_object(per_rank, record)
                if out is not None:
                    row = {"loader": loader, "cache": cache, "rep": rep, "world": world,
                           "nodes": world // ctx.local_world, "seconds": max(r["seconds"] for r in per_rank),
                           "started_at": started_at,
                           "disk_read_bytes": disk, "per_rank": per_rank,
                           "checkpoint_bytes": ctx.plan.checkpoint_bytes}
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    print(f"[bench] world {world} nodes {row['nodes']} {loader:17s} {cache} rep {rep}: "
                          f"{row['seconds']:.2f}s disk {_gb(disk)} GB" + (f"  ERROR {error}" if error else ""),
                          flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def logging_quiet() -> None:
    import logging
    import warnings

    logging.getLogger("distload").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")


def _gb(n) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"


# ----------------------------------------------------------------------------------------------------
# The driver: scenarios as torchrun jobs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run"]


def worker_args(ckpt: str, jsonl: Path, args, loaders: list[str]) -> list[str]:
    out = [str(Path(__file__).resolve()), "worker", "--checkpoint", ckpt, "--jsonl", str(jsonl),
           "--reps", str(args.reps), "--loaders", ",".join(loaders), "--caches", args.caches]
    if args.staging_mib:
        out += ["--staging-mib", str(args.staging_mib)]
    if args.quick:
        out += ["--warmup", "0"]
    if args.device != "cpu":
        out += ["--device", args.device]
    if args.tp:
        out += ["--tp", str(args.tp)]
    if args.pp > 1:
        out += ["--pp", str(args.pp)]
    return out


def child_env() -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_one_node(ckpt: Path, world: int, jsonl: Path, args, loaders: list[str], log) -> int:
    cmd = torchrun() + ["--standalone", "--nproc-per-node", str(world)] + worker_args(str(ckpt), jsonl, args, loaders)
    return _wait([subprocess.Popen(cmd, env=child_env(), stdout=log, stderr=subprocess.STDOUT)], args.scenario_timeout)


def _wait(procs: list, timeout: float) -> int:
    """Wait for the launchers; past `timeout` (a hung run) stop them: the scenario's finished runs still count."""
    deadline = time.monotonic() + timeout
    rc = 0
    for proc in procs:
        try:
            rc = max(rc, proc.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.terminate()
            for q in procs:
                try:
                    q.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    q.kill()
            return 124
    return rc


def can_emulate_nodes() -> tuple[bool, str]:
    if os.geteuid() != 0:
        return False, "needs root (unshare -m, mount --bind)"
    if not shutil.which("unshare"):
        return False, "unshare(1) not found"
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True)
    if probe.returncode:
        return False, f"unshare -m failed: {probe.stderr.decode().strip()}"
    return True, ""


def run_nodes(copies: list[Path], mount: Path, jsonl: Path, args, loaders: list[str], log) -> int:
    """One torchrun node agent per copy, each in its own mount namespace with its own copy of the checkpoint at
    `mount` (so each node has its own page cache)."""
    port = free_port()
    procs = []
    for node, copy in enumerate(copies):
        inner = torchrun() + ["--nnodes", str(len(copies)), "--node-rank", str(node),
                              "--nproc-per-node", str(args.node_ranks),
                              "--rdzv-backend", "static", "--rdzv-endpoint", f"127.0.0.1:{port}"]
        inner += worker_args(str(mount), jsonl, args, loaders)
        script = f"mount --bind {_q(copy)} {_q(mount)} && exec " + " ".join(_q(x) for x in inner)
        cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]
        procs.append(subprocess.Popen(cmd, env=child_env(), stdout=log, stderr=subprocess.STDOUT))
    return _wait(procs, args.scenario_timeout)


def _q(x) -> str:
    import shlex

    return shlex.quote(str(x))


# ----------------------------------------------------------------------------------------------------
# Summaries: table, JSON, chart


def summarize(rows: list[dict]) -> list[dict]:
    """One line per (scenario, cache, loader): medians over repetitions, worst rank."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["nodes"], r["world"], r["cache"], r["loader"]), []).append(r)
    out = []
    for (nodes, world, cache, loader), rs in groups.items():
        errors = sorted({p["error"] for r in rs for p in r["per_rank"] if p["error"]})
        ok = [r for r in rs if not any(p["error"] for p in r["per_rank"])]
        med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
        disk = [r["disk_read_bytes"] for r in ok if r["disk_read_bytes"] is not None]
        out.append({
            "scenario": f"{nodes} node{'s' * (nodes > 1)} x {world // nodes} rank{'s' * (world // nodes > 1)}",
            "nodes": nodes, "world": world, "cache": cache, "loader": loader, "reps": len(ok),
            "seconds": med([r["seconds"] for r in ok]),
            "seconds_all": [round(r["seconds"], 3) for r in ok],
            "disk_read_bytes": med(disk),
            "io_read_bytes": med([sum(p["io_read_bytes"] for p in r["per_rank"]) for r in ok]),
            "received_per_rank": med([max(p["bytes_received"] for p in r["per_rank"]) for r in ok]),
            "peak_rss_per_rank": med([max(p["peak_rss_bytes"] for p in r["per_rank"]) for r in ok]),
            "rss_over_shard": med([max(p["peak_rss_bytes"] - p["shard_bytes"] for p in r["per_rank"]) for r in ok]),
            "shard_per_rank": max(p["shard_bytes"] for r in rs for p in r["per_rank"]),
            "cpu_seconds": med([sum(p["cpu_seconds"] for p in r["per_rank"]) for r in ok]),
            "checkpoint_bytes": rs[0]["checkpoint_bytes"],
            "errors": errors,
        })
    order = {name: i for i, name in enumerate(LOADERS + EXTRA_LOADERS)}
    out.sort(key=lambda s: (s["nodes"], s["world"], s["cache"] != "cold", order.get(s["loader"], 99)))
    return out


def fingerprints_agree(rows: list[dict]) -> list[str]:
    """Problems: loaders whose params differ from distload's in the same scenario."""
    want: dict[tuple, list] = {}
    problems = []
    for r in rows:
        if r["rep"] == 0 and r["loader"] == "distload" and r["cache"] == "cold":
            want[(r["nodes"], r["world"])] = [p["fingerprint"] for p in r["per_rank"]]
    for r in rows:
        got = [p["fingerprint"] for p in r["per_rank"]]
        key = (r["nodes"], r["world"])
        if r["rep"] == 0 and None not in got and key in want and got != want[key]:
            problems.append(f"{r['loader']} ({r['cache']}, world {r['world']}, {r['nodes']} node(s)) loaded "
                            f"different bytes than distload")
    return problems


def _per_repetition(d: dict, b: dict) -> str:
    """The ratio of two loaders' times within each repetition (same disk moment): on a noisy machine the ratio
    of medians moves by several percent between runs, and these show how far a verdict is from chance."""
    a, c = d.get("seconds_all") or [], b.get("seconds_all") or []
    if len(a) != len(c) or len(a) < 3:  # a failed repetition: the lists no longer pair up
        return ""
    ratios = [x / y for x, y in zip(a, c)]
    return f"; per repetition {statistics.median(ratios):.3f}x median, {min(ratios):.2f}-{max(ratios):.2f}x"


def checks(summary: list[dict], staging_bytes: int) -> list[tuple[str, bool | None, str]]:
    """The issue's 'must show' list, evaluated on this run: (claim, holds, numbers)."""
    at = {(s["nodes"], s["world"], s["cache"], s["loader"]): s for s in summary}
    out = []

    def sec(key):
        s = at.get(key)
        return s["seconds"] if s and s["seconds"] is not None else None

    two = (2, 4, "cold")
    d, b = at.get(two + ("distload",)), at.get(two + (BASELINE,))
    if d and b and d["disk_read_bytes"] is not None:
        ratio = d["disk_read_bytes"] / d["checkpoint_bytes"]
        out.append(("2 nodes cold: distload reads the checkpoint once (<= 1.15x)", ratio <= 1.15,
                    f"{ratio:.2f}x ({_gb(d['disk_read_bytes'])} of {_gb(d['checkpoint_bytes'])} GB); "
                    f"baseline {b['disk_read_bytes'] / b['checkpoint_bytes']:.2f}x"))
    if d and b and d["seconds"] and b["seconds"]:
        r = d["seconds"] / b["seconds"]
        out.append(("2 nodes cold: distload time <= 0.8x baseline", r <= 0.8,
                    f"{d['seconds']:.3f}s vs {b['seconds']:.3f}s = {r:.3f}x" + _per_repetition(d, b)))
    for loader in ("distload", "distload-owners"):
        for world in sorted({s["world"] for s in summary if s["nodes"] == 1}):
            for cache, limit in (("cold", 1.0), ("warm", 1.25)):
                ds, bs = sec((1, world, cache, loader)), sec((1, world, cache, BASELINE))
                if ds and bs:
                    out.append((f"1 node x {world} {cache}: {loader} <= {limit}x baseline", ds / bs <= limit,
                                f"{ds:.3f}s vs {bs:.3f}s = {ds / bs:.3f}x"
                                + _per_repetition(at[(1, world, cache, loader)], at[(1, world, cache, BASELINE)])))
    slower = []
    compared = 0
    for s in summary:
        if s["loader"] != "fastsafetensors" or s["seconds"] is None:
            continue
        ds = sec((s["nodes"], s["world"], s["cache"], "distload"))
        if ds:
            compared += 1
            if ds > s["seconds"]:
                slower.append(f"{s['scenario']} {s['cache']}: {ds:.2f}s vs {s['seconds']:.2f}s")
    if compared:
        out.append(("distload at least as fast as fastsafetensors in every row", not slower,
                    "; ".join(slower) if slower else f"all {compared} rows"))
    over = []
    for s in summary:
        if s["loader"].startswith("distload") and s["rss_over_shard"] is not None:
            limit = staging_bytes + (400 << 20)
            if s["rss_over_shard"] > limit:
                over.append(f"{s['scenario']} {s['cache']}: shard + {s['rss_over_shard'] / 2**20:.0f} MiB")
    worst = max((s["rss_over_shard"] for s in summary if s["loader"].startswith("distload")
                 and s["rss_over_shard"] is not None), default=None)
    if worst is not None:
        out.append((f"distload peak RSS per rank <= shard + staging ({staging_bytes >> 20} MiB) + 400 MiB", not over,
                    "; ".join(over) if over else f"worst: shard + {worst / 2**20:.0f} MiB"))
    return out


def markdown(summary: list[dict], check_rows, problems: list[str], meta: dict) -> str:
    lines = [f"Checkpoint: {meta['checkpoint_desc']}. Machine: {meta['machine']}.", "",
             f"Command: `{meta['command']}`", "",
             "| scenario | cache | loader | load s (median) | vs baseline | storage read GB (diskstats) "
             "| read_bytes GB (all ranks) | received MB / rank | peak RSS MiB / rank | shard MiB / rank "
             "| CPU s (all ranks) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    base = {(s["nodes"], s["world"], s["cache"]): s["seconds"] for s in summary if s["loader"] == BASELINE}
    for s in summary:
        b = base.get((s["nodes"], s["world"], s["cache"]))
        if s["seconds"] is None:
            lines.append(f"| {s['scenario']} | {s['cache']} | {s['loader']} | failed: {'; '.join(s['errors'])[:80]} |"
                         " | | | | | | |")
            continue
        rel = f"{s['seconds'] / b:.2f}x" if b else "-"
        lines.append(f"| {s['scenario']} | {s['cache']} | {s['loader']} | {s['seconds']:.2f} | {rel} | "
                     f"{_gb(s['disk_read_bytes'])} | {_gb(s['io_read_bytes'])} | {s['received_per_rank'] / 1e6:.0f} | "
                     f"{s['peak_rss_per_rank'] / 2**20:.0f} | {s['shard_per_rank'] / 2**20:.0f} | "
                     f"{s['cpu_seconds']:.2f} |")
    for probe in meta.get("probes", {}).values():
        h2d = f", H2D (pinned, 256 MiB) {probe['h2d_pinned_gbps']:.1f} GB/s on {probe['device_name']}" \
            if "h2d_pinned_gbps" in probe else ""
        reached = [f"{s['loader']} {s['cache']} {s['checkpoint_bytes'] / s['seconds'] / 1e9:.2f}" for s in summary
                   if s["seconds"] and (s["world"], s["nodes"]) == (probe["world"], probe["nodes"])]
        lines.append(f"\nBandwidth, {probe['nodes']} node(s) x {probe['world'] // probe['nodes']} rank(s) on "
                     f"{probe['device']}: storage read cold by one process {probe['storage_read_gbps']:.2f} GB/s{h2d}; "
                     f"checkpoint GB/s reached: {', '.join(reached)}.")
    lines += ["", "Must show (issue 5), evaluated on this run:", ""]
    for claim, holds, numbers in check_rows:
        lines.append(f"- {'holds' if holds else 'DOES NOT HOLD'}: {claim} — {numbers}")
    lines.append("- " + ("every loader produced the same bytes on every rank (fingerprints)" if not problems
                         else "FINGERPRINT MISMATCH: " + "; ".join(problems)))
    return "\n".join(lines) + "\n"


def chart(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.patches
    import matplotlib.pyplot as plt

    groups = []
    for s in summary:
        g = (s["scenario"], s["cache"])
        if g not in groups:
            groups.append(g)
    loaders = [name for name in LOADERS + EXTRA_LOADERS if any(s["loader"] == name for s in summary)]
    at = {(s["scenario"], s["cache"], s["loader"]): s for s in summary}
    colors = {"distload": "#1f77b4", "distload-1reader": "#6baed6", "distload-owners": "#ff7f0e", BASELINE: "#d62728",
              "fastsafetensors": "#2ca02c", "dcp": "#9467bd", "distload-noshm": "#17becf",
              "distload-all-readers": "#08306b", "distload-threaded": "#9ecae1"}
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.3 * len(groups) + 2), 7.5), sharex=True)
    width = 0.8 / max(len([n for n in loaders if any(at.get((sc, c, n)) for sc, c in groups)]), 1)
    for k, (metric, label, scale) in enumerate((("seconds", "load time (s, median)", 1),
                                                ("disk_read_bytes", "storage read (GB)", 1e9))):
        ax = axes[k]
        for i, (scenario, cache) in enumerate(groups):
            present = [n for n in loaders if at.get((scenario, cache, n), {}).get(metric) is not None]
            for j, name in enumerate(present):  # each group's bars centred on its tick
                x = i + (j - (len(present) - 1) / 2) * width
                ax.bar(x, at[(scenario, cache, name)][metric] / scale, width, color=colors.get(name))
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
        if metric == "disk_read_bytes" and summary:
            ckpt_gb = summary[0]["checkpoint_bytes"] / 1e9
            ax.axhline(ckpt_gb, color="k", lw=0.8, ls="--")
            ax.text(len(groups) - 0.5, ckpt_gb, " checkpoint size", va="bottom", ha="right", fontsize=8)
    handles = [matplotlib.patches.Patch(color=colors.get(name), label=name) for name in loaders]
    fig.legend(handles=handles, ncol=len(loaders), fontsize=8, loc="upper center", bbox_to_anchor=(0.5, 0.955))
    axes[1].set_xticks(range(len(groups)))
    axes[1].set_xticklabels([f"{sc}\n{c}" for sc, c in groups], fontsize=8)
    fig.suptitle("Loading a checkpoint onto every rank: time and bytes read from storage (lower is better)")
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine() -> str:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    import torch

    return (f"{os.cpu_count()} CPU cores ({model or platform.processor()}), {mem:.0f} GiB RAM, "
            f"Linux {platform.release()}, torch {torch.__version__} (gloo, CPU)")


# ----------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command")
    w = sub.add_parser("worker", help="(internal) one torchrun job's ranks")
    w.add_argument("--checkpoint", required=True)
    w.add_argument("--jsonl", required=True)
    w.add_argument("--reps", type=int, default=3)
    w.add_argument("--loaders", default=",".join(LOADERS))
    w.add_argument("--caches", default="cold,warm")
    w.add_argument("--staging-mib", type=int, default=None)
    w.add_argument("--warmup", type=int, default=1)
    w.add_argument("--warmup-checkpoint", default=None, help="warm up on this (small) checkpoint instead")
    w.add_argument("--probes", type=int, default=1, help="0: skip the bandwidth probes")
    w.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    w.add_argument("--tp", type=int, default=None)
    w.add_argument("--pp", type=int, default=1)
    p.add_argument("--checkpoint", default=None, help="benchmark this checkpoint (default: build one in --workdir)")
    p.add_argument("--size-gib", type=float, default=1.0, help="size of the built checkpoint")
    p.add_argument("--files", type=int, default=4, help="safetensors files in the built checkpoint")
    p.add_argument("--workdir", default="/tmp/distload-bench", help="where checkpoints and node copies live")
    p.add_argument("--out", default=None, help="output directory (default: WORKDIR/results)")
    p.add_argument("--ranks", default=None, help="world sizes on one node (default 1,2,4; --quick: 2; cuda: 1)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where params live: cpu (gloo) or cuda (NCCL, one GPU per rank; default loaders distload, "
                        "every-rank-reads, fastsafetensors if installed; storage and H2D bandwidth measured too)")
    p.add_argument("--two-nodes", choices=("auto", "on", "off"), default=None,
                   help="emulate --nodes nodes x --node-ranks ranks (default auto; --quick: off)")
    p.add_argument("--nodes", type=int, default=2, help="emulated nodes of that scenario (default 2)")
    p.add_argument("--node-ranks", type=int, default=2, help="ranks per emulated node (default 2)")
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline stages (every-rank-reads then reads every tensor on every rank, as vLLM's "
                        "default loader does under PP, and keeps its stage's)")
    p.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel size (default: the world; below it the other ranks are replicas: "
                        "loaders every-rank-reads and distload* only)")
    p.add_argument("--reps", type=int, default=None, help="repetitions per loader and cache (default 3; --quick: 1)")
    p.add_argument("--loaders", default=None, help=f"comma list of {', '.join(LOADERS + EXTRA_LOADERS)}")
    p.add_argument("--caches", default="cold,warm")
    p.add_argument("--staging-mib", type=int, default=None, help="distload's --staging-mib (default: its own)")
    p.add_argument("--quick", action="store_true", help="a few-MB checkpoint, world 2, one repetition")
    p.add_argument("--scenario-timeout", type=float, default=900, help="seconds before a scenario's job is stopped")
    p.add_argument("--publish", action="store_true", help="write BENCHMARKS.md and benchmarks/ in the repository")
    args = p.parse_args(argv)
    if args.command == "worker":
        return worker(args)

    t_start = time.perf_counter()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    out = Path(args.out) if args.out else workdir / "results"
    out.mkdir(parents=True, exist_ok=True)
    args.reps = args.reps or (1 if args.quick else 3)
    on_cuda = args.device == "cuda"
    ranks_text = args.ranks if args.ranks is not None else ("2" if args.quick else "1" if on_cuda else "1,2,4")
    ranks = [int(x) for x in ranks_text.split(",") if x]
    two_nodes = args.two_nodes or ("off" if args.quick or on_cuda else "auto")
    chosen = (args.loaders or ",".join(LOADERS)).split(",")
    if (args.tp or args.pp > 1) and {"fastsafetensors", "dcp"} & set(chosen):
        raise SystemExit("--tp: fastsafetensors and dcp split over the whole world here; pass --loaders "
                         "distload,every-rank-reads (or other distload-* loaders)")
    if on_cuda:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: this machine has no CUDA device (torch.cuda.is_available() is False)")
    if on_cuda and not args.loaders:  # fastsafetensors only where it is installed (GPU images may lack it)
        import importlib.util

        args.loaders = "distload,every-rank-reads" + (",fastsafetensors" if importlib.util.find_spec("fastsafetensors")
                                                      else "")
    if args.checkpoint:
        ckpt = Path(args.checkpoint).resolve()
    else:
        size = int((6 << 20) if args.quick else args.size_gib * 2**30)
        ckpt = workdir / (f"llama-{size >> 20}mib-{args.files}files")
        print(f"[bench] building a {size / 2**30:.2f} GiB Llama-shaped bf16 checkpoint at {ckpt}", flush=True)
        make_checkpoint(ckpt, size, args.files, quick=args.quick)
    files = weight_files(ckpt)
    ckpt_bytes = sum((ckpt / f).stat().st_size for f in files)
    cfg = json.loads((ckpt / "config.json").read_text())
    jsonl = out / "runs.jsonl"
    jsonl.unlink(missing_ok=True)
    for stale in out.glob("probes-*.json"):
        stale.unlink()
    log_path = out / "bench.log"
    notes = []
    with open(log_path, "w") as log:
        for world in ranks:
            loaders = [x for x in (args.loaders or ",".join(LOADERS)).split(",") if x not in TWO_NODES_ONLY]
            print(f"[bench] 1 node x {world} rank(s): {', '.join(loaders)}; {args.caches}; {args.reps} rep(s)",
                  flush=True)
            rc = run_one_node(ckpt, world, jsonl, args, loaders, log)
            if rc:
                notes.append(f"1 node x {world}: torchrun exited {rc} (see {log_path})")
        if two_nodes != "off":
            ok, why = can_emulate_nodes()
            if not ok and two_nodes == "on":
                raise SystemExit(f"cannot emulate two nodes: {why}")
            if ok:
                copies = [ckpt] + [workdir / f"{ckpt.name}-node{k}" for k in range(1, args.nodes)]
                for copy in copies[1:]:
                    if not (copy / "model.safetensors.index.json").exists():
                        shutil.copytree(ckpt, copy, dirs_exist_ok=True)
                        os.sync()  # dirty pages cannot be evicted: a cold run must find the files on disk
                mount = workdir / "node-mount"
                mount.mkdir(exist_ok=True)
                loaders = [x for x in (args.loaders or ",".join(LOADERS)).split(",") if x not in ONE_NODE_ONLY]
                scenario = f"{args.nodes} nodes x {args.node_ranks} ranks"
                print(f"[bench] {scenario} (emulated): {', '.join(loaders)}; {args.caches}; {args.reps} rep(s)",
                      flush=True)
                rc = run_nodes(copies, mount, jsonl, args, loaders, log)
                if rc:
                    notes.append(f"{scenario}: torchrun exited {rc} (see {log_path})")
            else:
                notes.append(f"two emulated nodes skipped: {why}")
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()] if jsonl.exists() else []
    summary = summarize(rows)
    problems = fingerprints_agree(rows)
    from distload.plan import DEFAULT_STAGING_BYTES

    staging = (args.staging_mib << 20) if args.staging_mib else DEFAULT_STAGING_BYTES
    check_rows = checks(summary, staging)
    command = "python scripts/bench.py" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
    meta = {
        "command": command.strip(), "machine": machine(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "checkpoint": str(ckpt), "checkpoint_bytes": ckpt_bytes, "files": len(files),
        "checkpoint_desc": (f"Llama-shaped bf16, {ckpt_bytes / 2**30:.2f} GiB in {len(files)} safetensors files "
                            f"(hidden {cfg.get('hidden_size')}, {cfg.get('num_hidden_layers')} layers, "
                            f"{cfg.get('num_attention_heads')}/{cfg.get('num_key_value_heads')} heads, "
                            f"vocab {cfg.get('vocab_size')})"),
        "reps": args.reps, "staging_bytes": staging, "notes": notes, "device": args.device,
        "probes": {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("probes-*.json"))},
        "bench_seconds": round(time.perf_counter() - t_start, 1),
    }
    (out / "results.json").write_text(json.dumps(
        {"meta": meta, "summary": summary, "checks": [{"claim": c, "holds": h, "numbers": n} for c, h, n in check_rows],
         "fingerprint_problems": problems, "runs": rows}, indent=1))
    md = markdown(summary, check_rows, problems, meta)
    if notes:
        md += "\nNotes: " + "; ".join(notes) + "\n"
    (out / "results.md").write_text(md)
    if summary:
        chart(summary, out / "bench.png")
    print(md, flush=True)
    print(f"[bench] {len(rows)} runs in {meta['bench_seconds']:.0f}s; outputs in {out}", flush=True)
    if args.publish:
        publish(out, md, meta)
    return 1 if problems or not rows else 0


def publish(out: Path, md: str, meta: dict) -> None:
    dest = REPO / "benchmarks"
    dest.mkdir(exist_ok=True)
    for name in ("results.json", "results.md", "bench.png"):
        if (out / name).exists():
            shutil.copy(out / name, dest / name)
    publish_block("bench", f"Latest run ({meta['date']}, {meta['bench_seconds']:.0f} s):\n\n"
                           f"![load time and storage bytes per loader and scenario](benchmarks/bench.png)\n\n{md}")
    print(f"[bench] updated {REPO / 'BENCHMARKS.md'} and {dest}", flush=True)


def publish_block(name: str, block: str) -> None:
    """Put `block` between BENCHMARKS.md's `<!-- NAME:begin -->` and `<!-- NAME:end -->` (at its end if absent)."""
    path = REPO / "BENCHMARKS.md"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = f"{begin}\n{block}{end}"
    if begin in text and end in text:
        text = text[:text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text += "\n" + block + "\n"
    path.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
