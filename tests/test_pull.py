"""distload/transfer/pull.py and the progress board of node_pull.py, in real processes (no group needed)."""

from __future__ import annotations

import errno
import multiprocessing
import os

import pytest
import torch

from distload.transfer.node_pull import WINDOW_BYTES, ProgressBoard, windows_of
from distload.transfer.pull import FileMaps, pull_rows, why_not_usable

pytestmark = pytest.mark.skipif(why_not_usable() is not None, reason=f"no pulls here: {why_not_usable()}")


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_pull_rows_strided_both_sides_and_more_rows_than_one_call_takes():
    src = torch.arange(3000 * 40, dtype=torch.int32).view(torch.uint8).view(3000, 160)
    # 2500 rows (three calls of at most 1024 segments), bytes 24..88 of each source row ...
    dst_full = torch.zeros(2600, 100, dtype=torch.uint8)
    dst = dst_full[50:2550, 10:74]  # ... into a strided region of another tensor
    pull_rows(os.getpid(), src.data_ptr() + 300 * 160 + 24, 160, dst)
    assert torch.equal(dst, src[300:2800, 24:88])
    assert not dst_full[:50].any() and not dst_full[2550:].any() and not dst_full[:, :10].any() and not dst_full[:, 74:].any()
    # contiguous at both ends: one range
    flat = torch.empty(10, 160, dtype=torch.uint8)
    pull_rows(os.getpid(), src.data_ptr() + 7 * 160, 160, flat)
    assert torch.equal(flat, src[7:17])


def test_pull_rows_errors_name_the_cause():
    dst = torch.empty(4, 8, dtype=torch.uint8)
    with pytest.raises(OSError) as bad_address:
        pull_rows(os.getpid(), 8, 8, dst)  # nothing is mapped at address 8
    assert bad_address.value.errno == errno.EFAULT
    proc = multiprocessing.get_context("fork").Process(target=os._exit, args=(0,))
    proc.start()
    proc.join()
    with pytest.raises(OSError) as gone:
        pull_rows(proc.pid, dst.data_ptr(), 8, torch.empty(4, 8, dtype=torch.uint8))
    assert gone.value.errno == errno.ESRCH


def _pull_from_parent(pid: int, address: int, nbytes: int, queue) -> None:
    out = torch.empty(1, nbytes, dtype=torch.uint8)
    pull_rows(pid, address, nbytes, out)
    queue.put(bytes(out.numpy()))


def test_another_process_pulls_from_a_files_map_and_dropping_it_frees_the_rss(tmp_path):
    data = os.urandom(64 << 20)
    path = tmp_path / "weights.bin"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    maps = FileMaps()
    try:
        address = maps.address(fd, 0)
        ctx = multiprocessing.get_context("spawn")  # a process of its own, not a fork sharing our pages
        queue = ctx.Queue()
        proc = ctx.Process(target=_pull_from_parent, args=(os.getpid(), address + 4096 + 3, 1 << 20, queue))
        proc.start()
        got = queue.get(timeout=60)
        proc.join()
        assert got == data[4096 + 3:4096 + 3 + (1 << 20)]
        # the pages another process pulled, and the ones this one touches, are in this RSS until dropped
        before = _rss_kib()
        first_bytes = torch.empty((64 << 20) // 4096, 1, dtype=torch.uint8)
        pull_rows(os.getpid(), address, 4096, first_bytes)  # touch every page
        touched = _rss_kib()
        maps.drop(fd, 0, 64 << 20)
        dropped = _rss_kib()
        assert bytes(first_bytes.view(-1).numpy()) == data[::4096]
        assert touched - before > 48 << 10, (before, touched)
        assert touched - dropped > 48 << 10, (touched, dropped)
        again = torch.empty(1, 7, dtype=torch.uint8)
        pull_rows(os.getpid(), address + 5, 7, again)   # still readable after a drop: faulted in again
        assert bytes(again.view(-1).numpy()) == data[5:12]
    finally:
        maps.close()
        os.close(fd)


def _count_on_board(pid: int, fd: int, rank: int, queue) -> None:
    board = ProgressBoard(3, fd=fd, pid=pid)
    board.announce(rank)
    board.set(rank, 7)
    queue.put(board.slowest())


def test_progress_board_is_shared_and_knows_a_dead_rank():
    board = ProgressBoard(3)
    try:
        board.announce(0)
        board.set(0, 9)
        board.set(2, 8)
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        proc = ctx.Process(target=_count_on_board, args=(os.getpid(), board.own_fd, 1, queue))
        proc.start()
        assert queue.get(timeout=60) == (7, 1)   # it sees ours; we see its count below
        proc.join()
        assert board.slowest() == (7, 1)
        assert not board.gone(0) and not board.gone(2)   # rank 2 never announced: unknown is alive
        assert board.gone(1)                             # rank 1's process has exited
    finally:
        board.close()


def test_windows_group_one_readers_consecutive_buckets():
    from types import SimpleNamespace as NS

    w = WINDOW_BYTES
    buckets = [NS(reader=r, read_bytes=n) for r, n in [(0, w * 5 // 8), (0, w * 5 // 8), (1, 1), (0, 2 * w), (0, 1)]]
    plan = NS(buckets=buckets, checkpoint_bytes=sum(b.read_bytes for b in buckets))
    windows = windows_of(plan)
    assert [(reader, len(bs)) for reader, bs in windows] == [(0, 2), (1, 1), (0, 1), (0, 1)]
