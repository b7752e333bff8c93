"""Huge-page-backed host tensors (distload/transfer/host_memory.py): what the params and staging buffers are made of."""

from __future__ import annotations

import gc
import mmap
from pathlib import Path

import pytest
import torch

from distload.transfer import host_memory
from distload.loader import allocate
from distload.options import Tuning
from distload.plan import ParamSpec

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mapping_of(ptr: int) -> dict | None:
    """The /proc/self/smaps entry (header + fields) of the mapping holding address `ptr`."""
    entry = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            entry = {"range": (lo, hi)} if lo <= ptr < hi else None
        elif entry is not None and ":" in line:
            key, value = line.split(":", 1)
            entry[key] = value.strip()
            if key == "VmFlags":
                return entry
    return None


def _untouched_64_mib() -> torch.Tensor:
    """64 MiB in 1 MiB rows, not one page resident: a fresh anonymous mapping (torch.empty may reuse heap pages
    an earlier test left resident, as glibc's mmap threshold rises after a large free)."""
    region = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(region, dtype=torch.uint8).view(64, 1 << 20)   # the tensor keeps the mapping alive


def test_big_tensor_is_its_own_aligned_storage_with_the_right_shape():
    t = host_memory.empty((3, 1 << 20), torch.bfloat16, huge=True)
    assert t.shape == (3, 1 << 20) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % host_memory.HUGE_PAGE == 0
    t.fill_(2.5)
    assert t.float().sum().item() == 2.5 * 3 * (1 << 20)
    u = host_memory.empty((1 << 21,), torch.float8_e4m3fn, huge=True)
    assert u.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="this kernel gives no huge pages")
def test_big_tensor_asks_for_huge_pages_and_is_unmapped_with_its_last_view():
    t = host_memory.empty((8 << 20,), torch.uint8, huge=True)
    ptr = t.data_ptr()
    t.fill_(1)  # touch: the pages come now
    mapping = _mapping_of(ptr)
    assert mapping is not None and " hg" in " " + mapping["VmFlags"], mapping  # hg: MADV_HUGEPAGE was applied
    view = t[4096:]
    del t
    gc.collect()
    assert _mapping_of(ptr) is not None  # a view keeps the memory
    del view
    gc.collect()
    assert _mapping_of(ptr) is None


def _asked_for_huge_pages(t: torch.Tensor) -> bool:
    return " hg" in " " + _mapping_of(t.data_ptr())["VmFlags"]


def test_small_tensors_and_the_default_use_torchs_allocator(monkeypatch):
    assert not _asked_for_huge_pages(host_memory.empty((16,), torch.float32, huge=True))  # too small to ask
    monkeypatch.delenv("DISTLOAD_HUGEPAGES", raising=False)
    assert not _asked_for_huge_pages(host_memory.empty((4 << 20,), torch.uint8))  # opt-in: off by default


def test_allocate_uses_it_when_asked_and_keeps_tied_aliases(monkeypatch):
    monkeypatch.setenv("DISTLOAD_HUGEPAGES", "1")
    huge = Tuning.from_environment().hugepages  # read once, as a load does

    def spec(name, shape, dtype, alias_of=None):
        return ParamSpec(name=name, style="replicated", dtype=dtype, global_shape=shape, local_shape=shape,
                         alias_of=alias_of)

    specs = {"a.weight": spec("a.weight", (1024, 2048), "BF16"),
             "b.weight": spec("b.weight", (1024, 2048), "BF16", alias_of="a.weight"),
             "n.weight": spec("n.weight", (64,), "F32")}
    params = allocate(specs, "cpu", huge=huge)
    assert params["b.weight"] is params["a.weight"]
    assert params["a.weight"].data_ptr() % host_memory.HUGE_PAGE == 0
    assert params["n.weight"].shape == (64,) and params["n.weight"].dtype == torch.float32


def test_populate_faults_in_exactly_the_pages_under_a_region():
    t = _untouched_64_mib()
    rss_kib = lambda: int(_mapping_of(t.data_ptr())["Rss"].split()[0])  # noqa: E731
    before = rss_kib()
    if not host_memory.populate(t[8:40]):   # rows 8..39: 32 MiB, nothing written
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    assert 31 << 10 <= rss_kib() - before <= 34 << 10
    host_memory.populate(t[:, :4096])       # a column strip spans every row: all 64 MiB now
    assert rss_kib() - before >= 63 << 10
    assert not host_memory.populate(torch.empty(16, dtype=torch.uint8))  # small: left to the copy


def test_prefault_fills_the_regions_in_the_background_only_with_a_cpu_to_spare():
    import os
    import time

    from distload.plan.shard import Piece
    from distload.transfer.file_copy import Prefault

    t = _untouched_64_mib()
    params = {"t": t}
    pieces = [("t", Piece("s", (0, 16), (0, 1 << 20), 0, 0)), ("t", Piece("s", (16, 32), (0, 1 << 20), 32, 0))]
    rss_kib = lambda: int(_mapping_of(t.data_ptr())["Rss"].split()[0])  # noqa: E731
    before = rss_kib()
    cpus = len(os.sched_getaffinity(0))
    busy = Prefault(params, pieces, local_ranks=cpus)   # a rank per CPU already: no thread
    assert not busy.running
    busy.close()
    assert rss_kib() - before < 1 << 10
    spare = Prefault(params, pieces, local_ranks=cpus - 1)
    deadline = time.monotonic() + 30
    while spare.running and time.monotonic() < deadline:
        time.sleep(0.01)
    spare.close()
    if rss_kib() - before < 1 << 10 and not host_memory.populate(t[60:61]):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    assert 31 << 10 <= rss_kib() - before <= 35 << 10   # both 16 MiB regions (rows 0-15, 32-47), not the rest
