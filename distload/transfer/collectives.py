"""Small collectives: metadata objects, agreement flags, the reference forward's reductions.

Backend differences live here: NCCL moves only device tensors, gloo only host ones; gloo corrupts
non-contiguous tensors, so every buffer is checked.
"""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist


def active() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def require_contiguous(t: torch.Tensor, what: str) -> None:
    # gloo sends a non-contiguous tensor's *storage* bytes from its first element: silent corruption.
    if not t.is_contiguous():
        raise RuntimeError(f"{what}: wire buffers must be contiguous (gloo would corrupt a strided tensor)")


def all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    """Sum `t` over the group, in place."""
    require_contiguous(t, "all_reduce_sum")
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def all_gather_cat(t: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Concatenate every rank's `t` along `dim`, in rank order (equal shapes on all ranks)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return t
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t, group=group)
    return torch.cat(parts, dim=dim)


def object_device() -> torch.device:
    # NCCL moves only device tensors; gloo only host ones.
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_object(obj, src: int = 0):
    """Send a picklable object from `src` to every rank (metadata: headers, config, errors)."""
    if not active():
        return obj
    dev = object_device()
    if dist.get_rank() == src:
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(dev)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=dev)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=dev)
    dist.broadcast(size, src)
    if dist.get_rank() != src:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=dev)
    dist.broadcast(payload, src)
    return obj if dist.get_rank() == src else pickle.loads(payload.cpu().numpy().tobytes())


def outcome(fn) -> tuple[str, object]:
    """("ok", fn()), or ("error", the exception it raised): something to hand to shared_from_rank0."""
    try:
        return "ok", fn()
    except Exception as exc:
        return "error", exc


def shared_from_rank0(payload):
    """Rank 0's outcome (payload; anything on the other ranks) on every rank: its value, or its exception
    raised on every rank."""
    kind, value = broadcast_object(payload, src=0)
    if kind == "error":
        raise value
    return value


def computed_on_rank0(fn):
    """Run fn on rank 0 only (metadata: headers, manifests) and hand every rank its result; if it
    raised, every rank raises the same exception."""
    return shared_from_rank0(outcome(fn) if not active() or dist.get_rank() == 0 else None)


_OBJECT_SLOT_BYTES = 16 << 10


def _framed(data: bytes, size: int, dev) -> torch.Tensor:
    """`size` bytes on `dev`: data's length (8 bytes), then data where it fits (else the length alone travels)."""
    t = torch.zeros(size, dtype=torch.uint8, device=dev)
    t[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
    if len(data) <= size - 8:
        t[8:8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return t


def _length(framed: torch.Tensor) -> int:
    return int(framed[:8].cpu().view(torch.int64).item())


def _unframed(framed: torch.Tensor):
    return pickle.loads(framed[8:8 + _length(framed)].cpu().numpy().tobytes())


def all_gather_objects(obj) -> list:
    """Every rank's picklable `obj`, in rank order (small records only: all_gather is slow on gloo)."""
    if not active():
        return [obj]
    dev = object_device()
    data = pickle.dumps(obj)
    # One all-gather of fixed slots (8 bytes of length, then the record) when every record fits, which
    # the per-phase records do; a second, sized to the longest, when one does not. Each collective waits
    # for the slowest rank, so the usual case pays for one.
    slot = _OBJECT_SLOT_BYTES
    world = dist.get_world_size()
    mine = _framed(data, slot, dev)
    out = [torch.empty(slot, dtype=torch.uint8, device=dev) for _ in range(world)]
    dist.all_gather(out, mine)
    sizes = list(map(_length, out))
    if max(sizes) <= slot - 8:
        return list(map(_unframed, out))
    mine = torch.zeros(max(sizes), dtype=torch.uint8, device=dev)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.empty(max(sizes), dtype=torch.uint8, device=dev) for _ in range(world)]
    dist.all_gather(out, mine)
    return [pickle.loads(o[:n].cpu().numpy().tobytes()) for o, n in zip(out, sizes)]


def gather_objects(obj, dst: int = 0) -> list | None:
    """Every rank's picklable `obj` in rank order on rank `dst`, None on the others: what one rank alone needs
    (a sharded save's manifest) costs each other rank one send, where an all-gather would hand every rank every
    record. Two collectives: the longest record's size (all-reduce), then one gather of records that long."""
    if not active():
        return [obj]
    data = pickle.dumps(obj)
    mine = _framed(data, 8 + max_over_ranks([len(data)])[0], object_device())
    here = dist.get_rank() == dst
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())] if here else None
    dist.gather(mine, out, dst=dst)
    return [_unframed(o.cpu()) for o in out] if here else None


def count_over_ranks(flag: int) -> int:
    """The sum of one small integer over every rank (e.g. how many ranks failed): one all-reduce."""
    if not active():
        return flag
    t = torch.tensor([flag], dtype=torch.int64, device=object_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return int(t.item())


def max_over_ranks(values: list[int]) -> list[int]:
    """The element-wise maximum of a few small int64 values over every rank: one all-reduce."""
    if not active():
        return list(values)
    t = torch.tensor(values, dtype=torch.int64, device=object_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [int(x) for x in t.tolist()]


def barrier() -> None:
    if active():
        dist.barrier()

