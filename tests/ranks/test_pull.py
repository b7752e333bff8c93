"""distload/transfer/pull.py (borrowing another process's open files) and file_copy.py (a piece from a
file into its param), in real processes and real files (no process group needed)."""

from __future__ import annotations

import errno
import multiprocessing
import os
import resource

import pytest
import torch

from distload.checkpoint import RangeReader
from distload.plan import Source
from distload.plan.shard import Piece
from distload.transfer.file_copy import copy_piece
from distload.transfer.pull import borrow_fd, make_room_for_descriptors, why_not_usable

needs_pulls = pytest.mark.skipif(why_not_usable() is not None, reason=f"no pulls here: {why_not_usable()}")


def _lend(path: str, conn) -> None:
    """A process that opens a file, says which descriptor it holds and its pid, and waits to be told to go."""
    fd = os.open(path, os.O_RDONLY)
    conn.send((os.getpid(), fd))
    conn.recv()


@needs_pulls
def test_a_borrowed_descriptor_is_the_lenders_open_file_and_outlives_the_lender(tmp_path):
    data = os.urandom(3 << 20)
    (tmp_path / "w.safetensors").write_bytes(data)
    ctx = multiprocessing.get_context("spawn")  # a process of its own, as a reader rank is
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_lend, args=(str(tmp_path / "w.safetensors"), theirs))
    proc.start()
    try:
        pid, fd = ours.recv()
        mine = borrow_fd(pid, fd)
        with pytest.raises(OSError) as no_such:
            borrow_fd(pid, 999)  # the lender holds no descriptor 999
        assert no_such.value.errno == errno.EBADF
    finally:
        ours.send("go")
        proc.join()
    try:
        # the lender has exited; the duplicate still reads the file
        assert os.fstat(mine).st_ino == os.stat(tmp_path / "w.safetensors").st_ino
        assert os.pread(mine, 100, (2 << 20) + 7) == data[(2 << 20) + 7:(2 << 20) + 107]
    finally:
        os.close(mine)
    with pytest.raises(OSError) as gone:
        borrow_fd(pid, fd)
    assert gone.value.errno == errno.ESRCH


def test_a_reader_reads_through_an_adopted_descriptor_without_opening_the_path(tmp_path):
    data = os.urandom(1 << 20)
    (tmp_path / "a.safetensors").write_bytes(data)
    lender = RangeReader(str(tmp_path))
    borrower = RangeReader(str(tmp_path))
    try:
        lenders_own = lender.fd_of("a.safetensors")
        borrower.adopt("a.safetensors", lender.open_again("a.safetensors"))
        (tmp_path / "a.safetensors").rename(tmp_path / "moved")  # the path is gone: only the descriptor reads
        out = torch.empty(4096, dtype=torch.uint8)
        assert borrower.read_into("a.safetensors", 12345, out, tally=False) == 4096
        assert bytes(out.numpy()) == data[12345:12345 + 4096]
        assert borrower.files_opened == set() and borrower.bytes_read == 0
        # open_again is another open file than the lender's own one (its own position and read-ahead)
        assert borrower.fd_of("a.safetensors") != lenders_own
    finally:
        borrower.close()
        lender.close()


def _source(path, rows: int, cols: int, offset: int = 24) -> Source:
    return Source(name="w", file=path.name, offset=offset, dtype="BF16", shape=(rows, cols), shares=(),
                  broadcast=False)


def test_copy_piece_takes_whole_rows_and_row_parallel_columns_from_the_file(tmp_path):
    full = torch.randn(96, 80).to(torch.bfloat16)
    path = tmp_path / "t.safetensors"
    path.write_bytes(b"h" * 24 + full.view(torch.uint8).numpy().tobytes() + b"tail")
    src = _source(path, 96, 80)
    files = RangeReader(str(tmp_path))
    try:
        # column-parallel: rows 32..64 into rows 0..32 of a param
        rows = torch.zeros(32, 80, dtype=torch.bfloat16)
        assert copy_piece(files, src, rows, Piece(source="w", rows=(32, 64), cols=(0, 80), dst_row=0, dst_col=0)) == 32 * 80 * 2
        assert torch.equal(rows, full[32:64])
        # row-parallel: columns 20..40 of every row, strided in the file, into a strided region of the param
        cols = torch.zeros(96, 30, dtype=torch.bfloat16)
        assert copy_piece(files, src, cols, Piece(source="w", rows=(0, 96), cols=(20, 40), dst_row=0, dst_col=5)) == 96 * 20 * 2
        assert torch.equal(cols[:, 5:25], full[:, 20:40]) and not cols[:, :5].any() and not cols[:, 25:].any()
        # a param of another dtype: converted while copied
        wide = torch.zeros(32, 80, dtype=torch.float64)
        copy_piece(files, src, wide, Piece(source="w", rows=(0, 32), cols=(0, 80), dst_row=0, dst_col=0))
        assert torch.equal(wide, full[:32].double())
        assert files.bytes_read == 0  # callers count (node pulls count the reader's buckets once)
    finally:
        files.close()


def test_room_for_descriptors_raises_the_soft_limit_only_as_far_as_the_hard_one():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        make_room_for_descriptors(10)  # fits: nothing changes
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (soft, hard)
        if hard != resource.RLIM_INFINITY and hard > soft + 200:
            make_room_for_descriptors(soft)  # does not fit under soft, fits under hard
            assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] > soft
        if hard != resource.RLIM_INFINITY:
            with pytest.raises(OSError, match="ulimit -n"):
                make_room_for_descriptors(hard + 1)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
