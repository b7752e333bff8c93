"""Pulls: a process copies bytes straight out of another process's memory (`process_vm_readv`).

On one node every process shares the page cache, so the cheapest way for a rank to get its bytes is one
copy out of the page cache into its param, which is what every-rank-reads does. Going through a reader
costs a second copy (file -> the reader's buffer -> the param). With pulls the reader only maps the file
(FileMaps: no copy at all) and says where the map is; a rank copies its piece from that map into its
param with one `process_vm_readv` call (`pull_rows`), a strided piece (row-parallel columns) as one call
with one segment per row. The kernel reads the pages through the reader's map, from the page cache (or
the disk, once, when cold): the non-reader ranks still never open a weight file. node_pull.py runs the
protocol around these.

Linux only, same user; under Yama `ptrace_scope` 1 the reader allows its node's ranks to read its memory
with `PR_SET_PTRACER` for the transfer (AllowPulls), under 2 or 3 nobody can and the bucketed transfer is
used. `DISTLOAD_PULL=0` turns pulls off.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os

import numpy as np
import torch

_IOV_MAX = 1024                 # iovecs per call and side (Linux UIO_MAXIOV)
_MAX_CALL_BYTES = 1 << 30       # stay well below MAX_RW_COUNT in one call
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value

_libc = None
_usable: str | None | bool = False  # False: not probed yet; None: usable; str: why not


def _lib():
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.process_vm_readv.restype = ctypes.c_ssize_t
        lib.process_vm_readv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                                         ctypes.c_ulong, ctypes.c_ulong]
        lib.prctl.restype = ctypes.c_int
        lib.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        _libc = lib
    return _libc


def _yama_scope() -> int:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 0  # no Yama: same user is enough


def why_not_usable() -> str | None:
    """None if this process can pull from a same-node reader; otherwise why not (probed once)."""
    global _usable
    if os.environ.get("DISTLOAD_PULL", "1") == "0":
        return "DISTLOAD_PULL=0"
    if _usable is False:
        _usable = _probe()
    return _usable


def _probe() -> str | None:
    if not os.path.isdir("/proc/self"):
        return "not Linux"
    if _yama_scope() >= 2:
        return f"Yama ptrace_scope is {_yama_scope()}: only an administrator may read another process's memory"
    try:
        _lib()
    except (OSError, AttributeError) as exc:
        return f"no process_vm_readv in this C library: {exc}"
    # The syscall itself may be filtered (seccomp): try it on this process.
    src, dst = torch.arange(8, dtype=torch.uint8), torch.zeros(1, 8, dtype=torch.uint8)
    try:
        pull_rows(os.getpid(), src.data_ptr(), 8, dst)
    except OSError as exc:
        return f"process_vm_readv failed: {exc}"
    return None if torch.equal(dst[0], src) else "process_vm_readv returned other bytes"



class AllowPulls:
    """While open, the ranks of this node may read this (reader) process's memory even under Yama
    ptrace_scope 1, where by default only a process's ancestors may."""

    def __init__(self):
        self.set = _yama_scope() == 1 and _lib().prctl(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY, 0, 0, 0) == 0

    def close(self) -> None:
        if self.set:
            _lib().prctl(_PR_SET_PTRACER, 0, 0, 0, 0)
            self.set = False


class FileMaps:
    """A reader's read-only maps of whole checkpoint files, for its node's ranks to pull from (mapping
    reads nothing; pages come in as someone touches them)."""

    def __init__(self):
        self._maps: dict[int, tuple[mmap.mmap, int]] = {}  # fd -> (map, its address in this process)

    def address(self, fd: int, offset: int) -> int:
        """Where byte `offset` of the file is in this process (the file is mapped on first use)."""
        if fd not in self._maps:
            m = mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            self._maps[fd] = (m, np.frombuffer(m, dtype=np.uint8).ctypes.data)  # the array goes: no export left
        return self._maps[fd][1] + offset

    def drop(self, fd: int, offset: int, nbytes: int) -> None:
        """Forget this process's page-table entries for a range (page cache untouched), so that pages
        the ranks copied through this map stop counting in this process's RSS. A page shared with a
        range still to come is simply faulted in again when touched."""
        if fd not in self._maps or nbytes <= 0:
            return
        m = self._maps[fd][0]
        page = mmap.PAGESIZE
        lo = offset - offset % page
        hi = min(len(m), offset + nbytes + (-(offset + nbytes)) % page)
        if hi > lo:
            m.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def close(self) -> None:
        maps, self._maps = self._maps, {}
        for m, _ in maps.values():
            m.close()


def _iovecs(base: int, stride: int, seg: int, rows: int) -> np.ndarray:
    """One iovec per row (or one for all of them, if they are back to back)."""
    if stride == seg or rows <= 1:
        return np.array([[base, seg * rows]], dtype=np.uint64)
    out = np.empty((rows, 2), dtype=np.uint64)
    out[:, 0] = base + np.arange(rows, dtype=np.uint64) * np.uint64(stride)
    out[:, 1] = seg
    return out


def pull_rows(pid: int, remote: int, remote_stride: int, dst: torch.Tensor) -> None:
    """Copy `dst.shape[0]` rows of `dst.shape[1]` bytes, the first at address `remote` of process `pid`
    and each next one `remote_stride` further, into `dst` (uint8 [rows, bytes], rows may be strided).
    Raises OSError (with errno) if the other process's memory cannot be read."""
    rows, seg = dst.shape
    if rows == 0 or seg == 0:
        return
    if dst.stride(1) != 1:
        raise ValueError("pull_rows: destination rows must be contiguous")
    lib = _lib()
    # Rows per call: all of them when both sides are one range (up to a size cap), else one iovec per row.
    both_flat = (remote_stride == seg or rows == 1) and (dst.stride(0) == seg or rows == 1)
    step = max(1, _MAX_CALL_BYTES // seg) if both_flat else _IOV_MAX
    for r0 in range(0, rows, step):
        k = min(step, rows - r0)
        local = _iovecs(dst.data_ptr() + r0 * dst.stride(0), dst.stride(0), seg, k)
        far = _iovecs(remote + r0 * remote_stride, remote_stride, seg, k)
        want = k * seg
        got = lib.process_vm_readv(pid, local.ctypes.data, len(local), far.ctypes.data, len(far), 0)
        if got != want:
            code = ctypes.get_errno() if got < 0 else errno.EFAULT
            raise OSError(code, f"read {max(got, 0)} of {want} bytes from process {pid}: {os.strerror(code)}")
