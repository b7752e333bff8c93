"""Host memory for params and staging buffers: backed by transparent huge pages where the kernel offers them.

Why: loading is mostly copying bytes into memory no one has touched yet, and on these machines the first
touch of a 4 KiB page costs more than the copy itself (page-cache reads into fresh memory ran at 1.3-1.9
GB/s, into the same memory a second time at 6-11 GB/s). With 2 MiB pages there are 512x fewer faults: a
fresh 256 MiB param filled from the page cache in 38 ms instead of 145-207 ms (`scripts/bench.py` has the
whole-load numbers). Linux's default THP mode is `madvise`: only memory that asks gets huge pages, and
torch's CPU allocator does not ask (unless THP_MEM_ALLOC_ENABLE=1 is set before torch starts, for the
whole process), so distload maps its own large buffers and asks for them.

Each big tensor is its own anonymous mapping (its own storage, freed when the tensor is): tensors never
share a storage, which safetensors' save_file and torch.save rely on.

Opt-in (DISTLOAD_HUGEPAGES=1, read once into options.Tuning), because on the machine we measure on, a VM, huge pages made loads both
faster and slower: a warm 4-rank load of 1 GiB went from 0.61 s to 0.44-0.50 s in some runs and to 0.81 s
in others, and cold loads took 0.65-2.5 s instead of 0.75-0.9 s (`scripts/bench.py --loaders
distload,distload-thp,every-rank-reads`). The fault cost of a 2 MiB page there depends on the state of the
host's memory (a freshly freed 2 MiB block is likely returned to the host and must come back), which a
loader cannot see. On bare metal the first-touch saving above is what remains.
"""

from __future__ import annotations

import ctypes
import math
import mmap

import torch

HUGE_PAGE = 2 << 20
# Below this a tensor is left to torch's allocator: a huge page would be mostly empty.
MIN_BYTES = HUGE_PAGE


_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_libc = None


def populate(region: torch.Tensor) -> bool:
    """Fault in the pages under a region of a CPU tensor (a view, strided or not) now, in one call
    (`MADV_POPULATE_WRITE`), just before a copy fills it, rather than one fault per 4 KiB page inside the
    copy. Measured here, a fresh 256 MiB buffer filled from the page cache: 0.107-0.126 CPU-s populated
    first vs 0.135-0.139 faulted by the copy (the zeroing is the same; what goes is 65k separate faults).
    Per piece, not per param at allocation: populating everything up front runs before the first read,
    so a cold load loses the overlap of those faults with the disk's read-ahead (the cold rows of the one
    bench run made that way were the slowest of the day, e.g. 2 ranks 1.23x vs 1.05-1.13x).
    False where nothing was done (small regions, other devices, kernels before 5.14)."""
    global _libc
    if region.device.type != "cpu" or region.numel() == 0:
        return False
    span = region.element_size() * (1 + sum((n - 1) * st for n, st in zip(region.shape, region.stride())))
    if span < MIN_BYTES or not hasattr(mmap, "PAGESIZE"):
        return False
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start = region.data_ptr() - region.data_ptr() % mmap.PAGESIZE
    return _libc.madvise(start, region.data_ptr() + span - start, _MADV_POPULATE_WRITE) == 0


def empty(shape, dtype: torch.dtype, device: torch.device | str = "cpu", huge: bool = False) -> torch.Tensor:
    """torch.empty(shape, dtype, device); a large CPU tensor in huge-page-backed memory if `huge` (the
    caller passes Tuning.hugepages: DISTLOAD_HUGEPAGES=1) and the kernel has transparent huge pages."""
    device = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes < MIN_BYTES or not huge or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype, device=device)
    # Huge pages need 2 MiB-aligned addresses: map one page more and start at the first aligned byte.
    # Untouched pages at either end cost address space, not memory.
    length = -(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE
    try:
        region = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without THP or a sandbox that refuses madvise: ordinary pages
        return torch.empty(shape, dtype=dtype, device=device)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds `region` alive as long as any view of it
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start:start + nbytes].view(dtype).view(shape)
