"""One small helper to run a function on W gloo ranks (real process group, real processes), or on NCCL
ranks, one GPU each, where there are GPUs (tests/test_cuda.py).

torchrun costs ~5 s to reach the first collective, so tests run many cases inside one call of
`run_ranks` rather than one process group per case. The function runs with the process group
initialised and the torchrun-style environment set (RANK, WORLD_SIZE, LOCAL_RANK, ...), so code under
test reads its topology exactly as it would under torchrun.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args, queue, init_group, store_file, backend):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0",
    )
    if backend == "gloo":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a GPU machine's gloo ranks load onto the CPU, as on CI
    try:
        if init_group:
            # A file store, not TCP: a free port picked here can be taken by a concurrent test before
            # rank 0 binds it, and then ranks rendezvous with a stranger and hang.
            import torch.distributed.nn.functional  # noqa: F401  (before the group: see topology.init_process_group)
            options = {}
            if backend == "nccl":
                import torch

                torch.cuda.set_device(rank)
                options["device_id"] = torch.device("cuda", rank)
            dist.init_process_group(backend, init_method=f"file://{store_file}", rank=rank, world_size=world,
                                    **options)
        queue.put((rank, "ok", fn(*args)))
    except BaseException as exc:  # reported to the parent, which re-raises with the rank named
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if init_group and dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world: int, fn, *args, init_group: bool = True, timeout: float = 300.0, backend: str = "gloo") -> list:
    """Run fn(*args) on `world` gloo ranks (backend="nccl": NCCL ranks, rank r on GPU r); return the per-rank
    results in rank order.

    fn must be importable (a module-level function). Raises AssertionError with every failing rank's
    traceback if any rank raised.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    store_dir = tempfile.mkdtemp(prefix="distload-store-")
    store_file = os.path.join(store_dir, "store")
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, queue, init_group, store_file, backend))
             for r in range(world)]
    # Hidden from the children's start, not only inside them: a child imports the test module (to unpickle
    # fn), and a module that asks torch.cuda.is_available() at import fixes CUDA's device list before
    # _entry could hide the GPUs.
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if backend == "gloo":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        for p in procs:
            p.start()
    finally:
        if visible is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
    results: dict[int, tuple[str, object]] = {}
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout)
            results[rank] = (status, value)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        shutil.rmtree(store_dir, ignore_errors=True)
    errors = {r: v for r, (s, v) in results.items() if s == "error"}
    if errors:
        raise AssertionError("\n".join(f"--- rank {r} ---\n{v}" for r, v in sorted(errors.items())))
    return [results[r][1] for r in range(world)]
