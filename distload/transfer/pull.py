"""Borrowing a reader's open files: a process takes a duplicate of another process's file descriptor.

On one node every process shares the page cache, so the cheapest way for a rank to get its bytes is one
copy out of the page cache into its param, which is what every-rank-reads does. Going through a reader
costs a second copy (file -> the reader's buffer -> the param). Here the reader opens the files and says
which descriptors it holds; a rank takes duplicates of them (`pidfd_getfd`, Linux 5.6: the same open
file, not a new open of the path) and reads its pieces through them straight into its params
(file_copy.py). The non-reader ranks never open a weight file, and each byte is read from storage once
(the page cache is shared). node_pull.py runs the protocol around this.

Linux only, same user: taking another process's descriptor needs the same permission as ptrace. Under
Yama `ptrace_scope` 1 the reader allows its node's ranks with `PR_SET_PTRACER` while they borrow
(AllowPulls); under 2 or 3 nobody can and the bucketed transfer is used. `DISTLOAD_PULL=0` turns pulls
off (options.Tuning; transfer/route.py decides the route before any byte moves).
"""

from __future__ import annotations

import ctypes
import os
import platform
import resource

_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value
# pidfd_getfd's number is the same on every architecture that has it (the syscall table was unified
# before it was added); pidfd_open is 434 likewise, but os.pidfd_open exists for it.
_SYS_PIDFD_GETFD = 438

_libc = None
_usable: str | None | bool = False  # False: not probed yet; None: usable; str: why not


def _lib():
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.syscall.restype = ctypes.c_long
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


def why_not_usable(enabled: bool = True, strategy: str | None = None) -> str | None:
    """None if this process can borrow a same-node reader's descriptors; otherwise why not (the OS is
    probed once). enabled: Tuning.pull (DISTLOAD_PULL); strategy: the reader's read strategy."""
    global _usable
    if not enabled:
        return "DISTLOAD_PULL=0"
    if strategy == "odirect":
        return "the reader reads with O_DIRECT, around the page cache"
    if _usable is False:
        _usable = _probe()
    return _usable


def _probe() -> str | None:
    if platform.system() != "Linux" or not hasattr(os, "pidfd_open"):
        return "not Linux (no pidfd_open)"
    if _yama_scope() >= 2:
        return f"Yama ptrace_scope is {_yama_scope()}: only an administrator may take another process's files"
    # The syscall may be missing (Linux < 5.6) or filtered (seccomp): try it on this process.
    try:
        fd = borrow_fd(os.getpid(), 0)
    except OSError as exc:
        return f"pidfd_getfd failed: {exc}"
    os.close(fd)
    return None


def borrow_fd(pid: int, fd: int) -> int:
    """A new descriptor in this process for the open file that is descriptor `fd` of process `pid` (closed
    by the caller). Raises OSError (with errno) if that process is gone, has no such descriptor, or may
    not be inspected by this one."""
    lib = _lib()
    pidfd = os.pidfd_open(pid)
    try:
        got = lib.syscall(ctypes.c_long(_SYS_PIDFD_GETFD), ctypes.c_int(pidfd), ctypes.c_int(fd), ctypes.c_uint(0))
        if got < 0:
            code = ctypes.get_errno()
            raise OSError(code, f"descriptor {fd} of process {pid}: {os.strerror(code)}")
        return int(got)
    finally:
        os.close(pidfd)


def make_room_for_descriptors(extra: int) -> None:
    """Raise this process's soft limit on open files (up to the hard one) if `extra` more might not fit:
    a reader lends every rank of its node its own descriptor of each file (a few thousand for a large
    checkpoint on 8 ranks, above the usual soft limit of 1024). OSError if even the hard limit is short."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = len(os.listdir("/proc/self/fd"))
    want = in_use + extra + 64
    if want <= soft:
        return
    if hard != resource.RLIM_INFINITY and want > hard:
        raise OSError(f"{extra} more open files needed, {in_use} open, hard limit {hard} (ulimit -n)")
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


class AllowPulls:
    """While open, the ranks of this node may take this (reader) process's descriptors even under Yama
    ptrace_scope 1, where by default only a process's ancestors may."""

    def __init__(self):
        self.set = _yama_scope() == 1 and _lib().prctl(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY, 0, 0, 0) == 0

    def close(self) -> None:
        if self.set:
            _lib().prctl(_PR_SET_PTRACER, 0, 0, 0, 0)
            self.set = False
