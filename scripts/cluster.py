"""An emulated cluster on one Linux machine (root): N nodes whose links and storage, not the CPU, are the limit.

Node i is a network namespace `<prefix>n<i>` (eth0 = <subnet>.<i+1>/24) wired by a veth to one bridge in a
switch namespace `<prefix>sw`, so nothing is added to the host's own network and the host's firewall never
sees the traffic. A tbf qdisc on both ends of each veth is the node's upload (node end) and download (switch
end): each node has its own full-duplex NIC of `rate` on a non-blocking switch. This kernel has no netem, so
links have no propagation delay (tbf's `latency` only bounds its queue); with a bandwidth-bound load the
round trip (30-50 us idle, ~1.4 ms under load) does not matter.

A process on node i runs in its blkio cgroup (joined before `ip netns exec`, which remounts /sys and hides
/sys/fs/cgroup), in its network namespace, and in a private mount namespace where its own copy of the data is
bind-mounted at one path (the page cache is global: only separate files give each node a cache of its own),
/dev/shm is a tmpfs of its own, and the blkio counters are mounted again so the node can read its own.

Storage (cgroup v1 blk-throttle, on the whole disk holding the data; v1 is flat here, so the modes are
alternatives): "shared" puts every node in one cgroup with one read cap (one file server for the job);
"per-node" gives each node a cgroup and a cap of its own (local disks). read_ahead_kb is per disk, for the
whole machine: set for the run, restored after it (also after a killed run: STATE, then `down`).

    with Cluster(2, rate="400mbit", storage="per-node", storage_mbps=100, data=ckpt_dir) as c:
        procs = [c.popen(i, c.torchrun(i, 1, ["-m", "distload", "load", "/mnt/x"]), bind={copies[i]: "/mnt/x"})
                 for i in range(c.nodes)]

Everything it makes goes, on any exit of the `with` (an exception, SIGTERM, Ctrl-C): node processes, namespaces
(the veths, bridge and qdiscs go with them), cgroups, the read-ahead change. SIGKILL leaves them:
`python scripts/cluster.py down` (or the next Cluster) removes them; `leftovers` lists what is left.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

BLKIO = Path("/sys/fs/cgroup/blkio")
RUN_NETNS = Path("/run/netns")
ETHERNET_OVERHEAD = 14 + 4 + 8 + 12   # header, FCS, preamble, gap: not counted by tbf, which counts L2 frames
TCP_IP_HEADERS = 52                     # IPv4 20 + TCP 20 + timestamps 12


def state_file(prefix: str) -> Path:
    return Path(f"/run/{prefix}-cluster.json")   # what to restore if a run dies before it can


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, capture_output=True, text=True)
    if check and r.returncode:
        raise RuntimeError(f"{shlex.join(argv)}: {r.stderr.strip()}")
    return r


def rate_bits(rate: str) -> float:
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if rate.endswith(unit):
            return float(rate[:-len(unit)]) * scale
    return float(rate)


def goodput_bytes(rate: str, mtu: int = 1500) -> float:
    """TCP payload bytes/s through a tbf of `rate`: it counts each frame's L2 bytes (mtu + 14), so a 1500-byte
    MTU gives 1448 / 1514 of the rate (measured 47.7 MB/s at 400 Mbit/s with iperf3)."""
    return rate_bits(rate) / 8 * (mtu - TCP_IP_HEADERS) / (mtu + 14)


def whole_disk(path: str) -> str:
    """maj:min of the whole disk holding `path` (throttle rules and read_ahead_kb are per disk)."""
    st = os.stat(path)
    dev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    if (dev / "partition").exists():
        dev = dev.resolve().parent
    return (dev / "dev").read_text().strip()


def read_ahead_path(disk: str) -> Path:
    return Path(f"/sys/dev/block/{disk}/queue/read_ahead_kb")


def can_shape(data: str = "/tmp") -> tuple[bool, str]:
    """(True, "") when this machine can emulate shaped nodes, else (False, why)."""
    if os.geteuid() != 0:
        return False, "needs root (network namespaces, tc, blkio cgroups)"
    for tool in ("ip", "tc", "mount"):
        if not shutil.which(tool):
            return False, f"{tool}(8) not found"
    if not (BLKIO / "blkio.throttle.read_bps_device").exists():
        return False, f"no cgroup v1 blkio throttle at {BLKIO} (cgroup v2 io.max is not supported here)"
    probe = "dlprobe"
    try:
        sh("ip", "netns", "add", probe)
        sh("ip", "-n", probe, "link", "set", "lo", "up")
        sh("ip", "netns", "exec", probe, "tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", "1gbit",
           "burst", "131072", "latency", "20ms")
    except (RuntimeError, OSError) as exc:
        return False, f"network namespaces or tbf unavailable: {exc}"
    finally:
        sh("ip", "netns", "del", probe, check=False)
        _unmount_run_netns()
    try:
        whole_disk(data)
    except OSError as exc:
        return False, f"no block device under {data}: {exc}"
    return True, ""


class Cluster:
    def __init__(self, nodes: int, rate: str | None = "400mbit", storage: str | None = None,
                 storage_mbps: float = 100, data: str = "/tmp", read_ahead_kb: int | None = None,
                 mtu: int = 1500, prefix: str = "dlb", subnet: str = "10.78.0", queue: str = "20ms"):
        if storage not in (None, "shared", "per-node"):
            raise ValueError(f"storage {storage!r}: shared, per-node or None")
        self.nodes, self.rate, self.storage, self.mtu = nodes, rate, storage, mtu
        self.storage_bps = int(storage_mbps * 1e6)
        self.read_ahead_kb, self.prefix, self.subnet, self.queue = read_ahead_kb, prefix, subnet, queue
        # tbf burst: at least one 64 KiB GSO super-packet (less cost 12% of the rate) and ~2 ms of the rate
        self.burst = max(128 << 10, int(rate_bits(rate) / 8 * 0.002)) if rate else 0
        self.disk = whole_disk(data)
        self.procs: list[subprocess.Popen] = []

    def ns(self, i: int) -> str:
        return f"{self.prefix}n{i}"

    @property
    def switch(self) -> str:
        return f"{self.prefix}sw"

    def ip(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    @property
    def master_addr(self) -> str:
        return self.ip(0)

    def cgroup(self, i: int) -> Path | None:
        root = BLKIO / f"{self.prefix}cluster"
        return {None: None, "shared": root, "per-node": root / f"node{i}"}[self.storage]

    def describe(self) -> dict:
        """What a row was measured under (every number a reader needs to redo the expectation)."""
        ra = read_ahead_path(self.disk)
        return {"nodes": self.nodes, "rate": self.rate, "mtu": self.mtu, "tbf_burst": self.burst,
                "link_goodput_bytes": goodput_bytes(self.rate, self.mtu) if self.rate else None,
                "delay": "none (no netem in this kernel)", "storage": self.storage,
                "storage_bytes_per_s": self.storage_bps if self.storage else None, "disk": self.disk,
                "read_ahead_kb": int(ra.read_text()) if ra.exists() else None}

    # -- build and tear down ---------------------------------------------------------------------------

    def __enter__(self) -> "Cluster":
        teardown(self.prefix)   # whatever a killed run left
        self._old_term = signal.signal(signal.SIGTERM, _exit_on_signal)   # so that __exit__ runs
        try:
            self._build()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _build(self) -> None:
        sw = self.switch
        sh("ip", "netns", "add", sw)
        sh("ip", "-n", sw, "link", "add", "br0", "mtu", str(self.mtu), "type", "bridge")
        sh("ip", "-n", sw, "link", "set", "br0", "up")
        for i in range(self.nodes):
            ns, port = self.ns(i), f"p{i}"
            sh("ip", "netns", "add", ns)
            # created straight into both namespaces: the name eth0 never meets the host's
            sh("ip", "link", "add", "eth0", "mtu", str(self.mtu), "netns", ns, "type", "veth",
               "peer", "name", port, "mtu", str(self.mtu), "netns", sw)
            sh("ip", "-n", sw, "link", "set", port, "master", "br0", "up")
            sh("ip", "-n", ns, "addr", "add", f"{self.ip(i)}/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "lo", "up")   # down in a new namespace: ranks of a node use it
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            if self.rate:
                for where, dev in ((ns, "eth0"), (sw, port)):   # the node's upload, its download
                    sh("ip", "netns", "exec", where, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                       "rate", self.rate, "burst", str(self.burst), "latency", self.queue)
        if self.storage:
            rule = f"{self.disk} {self.storage_bps}"
            root = BLKIO / f"{self.prefix}cluster"
            root.mkdir()
            for i in range(self.nodes if self.storage == "per-node" else 1):
                cg = self.cgroup(i)
                cg.mkdir(exist_ok=True)
                (cg / "blkio.throttle.read_bps_device").write_text(rule)
        if self.read_ahead_kb is not None:
            ra = read_ahead_path(self.disk)
            state = state_file(self.prefix)
            if not state.exists():
                state.write_text(json.dumps({"read_ahead_kb": {self.disk: int(ra.read_text())}}))
            ra.write_text(str(self.read_ahead_kb))

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
            teardown(self.prefix)
        finally:
            signal.signal(signal.SIGTERM, getattr(self, "_old_term", signal.SIG_DFL))

    def stop(self) -> None:
        """Kill what popen started (a cgroup with tasks cannot be removed), each by its process group."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        self.procs = []

    # -- running on a node -----------------------------------------------------------------------------

    def argv(self, i: int, cmd: list[str], bind: dict | None = None, env: dict | None = None) -> list[str]:
        """`cmd` on node i: its cgroup, its network namespace, its mounts (`bind` {source: target}), its
        /dev/shm, and its blkio counters at the usual path (node_counter)."""
        env = {"GLOO_SOCKET_IFNAME": "eth0", "NODE_RANK": str(i), **(env or {})}
        steps = [f"mount --bind {shlex.quote(str(src))} {shlex.quote(str(dst))}" for src, dst in (bind or {}).items()]
        steps.append("mount -t tmpfs -o size=50% tmpfs /dev/shm")
        if self.storage:
            steps += [f"mount -t tmpfs cg {BLKIO.parent}", f"mkdir {BLKIO}", f"mount -t cgroup -o blkio blkio {BLKIO}"]
        steps.append('exec "$@"')
        argv = ["ip", "netns", "exec", self.ns(i), "env", *[f"{k}={v}" for k, v in env.items()],
                "sh", "-ec", " && ".join(steps), "sh", *map(str, cmd)]
        cg = self.cgroup(i)
        if cg is not None:   # first: inside the namespace /sys/fs/cgroup is gone
            argv = ["sh", "-ec", f'echo $$ > {cg}/cgroup.procs && exec "$@"', "sh", *argv]
        return argv

    def popen(self, i: int, cmd: list[str], bind: dict | None = None, env: dict | None = None,
              **kw) -> subprocess.Popen:
        p = subprocess.Popen(self.argv(i, cmd, bind, env), start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def torchrun(self, i: int, nproc: int, args: list[str], port: int = 29511) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(self.nodes), "--node-rank", str(i),
                "--nproc-per-node", str(nproc), "--rdzv-backend", "static",
                "--rdzv-endpoint", f"{self.master_addr}:{port}", *args]

    def node_counter(self, i: int) -> str | None:
        """The node's blkio byte counters as the node sees them (argv mounts them again inside)."""
        cg = self.cgroup(i)
        return str(cg / "blkio.throttle.io_service_bytes") if cg is not None else None

    def link_bytes(self, i: int) -> tuple[int, int]:
        """(bytes node i sent, bytes it received) on its link so far, L2, read on the switch side."""
        stats = json.loads(sh("ip", "-n", self.switch, "-j", "-s", "link", "show", f"p{i}").stdout)[0]["stats64"]
        return stats["rx"]["bytes"], stats["tx"]["bytes"]

    def sample(self, procs: list) -> list[tuple[int, int, int, int]]:
        """Per node (procs[i]: a process running on node i), (storage bytes read, bytes sent, bytes received,
        TCP retransmission timeouts) so far: cheap enough to poll (no subprocess), through the node's
        /proc/<pid>/net/."""
        out = []
        for i, p in enumerate(procs):
            counter = self.node_counter(i) if self.storage == "per-node" or i == 0 else None
            stored = disk_read_bytes(counter, self.disk) if counter else 0
            sent = received = timeouts = 0
            try:
                for line in Path(f"/proc/{p.pid}/net/dev").read_text().splitlines():
                    name, _, fields = line.partition(":")
                    if name.strip() == "eth0":
                        f = fields.split()
                        received, sent = int(f[0]), int(f[8])
                ext = [line.split() for line in Path(f"/proc/{p.pid}/net/netstat").read_text().splitlines()
                       if line.startswith("TcpExt:")]
                timeouts = int(dict(zip(ext[0], ext[1])).get("TCPTimeouts", 0))
            except OSError:   # the node's process is gone
                pass
            out.append((stored, sent, received, timeouts))
        return out


def disk_read_bytes(counter: str, disk: str) -> int:
    """Bytes read from `disk` in a blkio cgroup, from its io_service_bytes file."""
    for line in Path(counter).read_text().splitlines():
        fields = line.split()
        if len(fields) == 3 and fields[0] == disk and fields[1] == "Read":
            return int(fields[2])
    return 0


def _exit_on_signal(signum, _frame):
    raise SystemExit(128 + signum)


def _mounted(path: Path) -> bool:   # os.path.ismount misses /run/netns, a bind mount of itself
    return any(line.split()[4] == str(path) for line in Path("/proc/self/mountinfo").read_text().splitlines())


def _unmount_run_netns() -> None:
    """`ip netns add` made /run/netns a bind mount of itself; undo that once no namespace is left in it."""
    if RUN_NETNS.is_dir() and not any(RUN_NETNS.iterdir()) and _mounted(RUN_NETNS):
        sh("umount", str(RUN_NETNS), check=False)
        try:
            RUN_NETNS.rmdir()
        except OSError:
            pass


def leftovers(prefix: str = "dlb") -> dict:
    """What of a cluster with this prefix still exists (all empty / False once it is gone)."""
    names = [line.split()[0] for line in sh("ip", "netns", "list").stdout.splitlines() if line.split()]
    cg = BLKIO / f"{prefix}cluster"
    return {"netns": [n for n in names if n.startswith(prefix) and n[len(prefix):][:1] in ("n", "s")],
            "cgroups": sorted(str(p) for p in [cg, *cg.rglob("*")] if p.is_dir()) if cg.exists() else [],
            "read_ahead_to_restore": state_file(prefix).exists()}


def teardown(prefix: str = "dlb") -> None:
    """Remove every namespace (with its veths, bridge and qdiscs), cgroup and read-ahead change of `prefix`;
    safe to call any number of times."""
    for ns in leftovers(prefix)["netns"]:
        for pid in sh("ip", "netns", "pids", ns, check=False).stdout.split():   # stragglers of a killed run
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        sh("ip", "netns", "del", ns, check=False)
    _unmount_run_netns()
    cg = BLKIO / f"{prefix}cluster"
    if cg.exists():
        for d in sorted((p for p in [cg, *cg.rglob("*")] if p.is_dir()), key=lambda p: -len(p.parts)):
            for pid in (d / "cgroup.procs").read_text().split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for _ in range(100):   # killed tasks leave the cgroup as they exit
                try:
                    d.rmdir()
                    break
                except OSError:
                    time.sleep(0.05)
    state = state_file(prefix)
    if state.exists():
        for disk, kb in json.loads(state.read_text())["read_ahead_kb"].items():
            read_ahead_path(disk).write_text(str(kb))
        state.unlink()


def main() -> int:
    p = argparse.ArgumentParser(description="emulated cluster: remove (down) or list (leftovers) what a run left")
    p.add_argument("what", choices=("down", "leftovers", "check"))
    p.add_argument("--prefix", default="dlb")
    a = p.parse_args()
    if a.what == "down":
        teardown(a.prefix)
    if a.what == "check":
        ok, why = can_shape()
        print("ok" if ok else f"cannot shape: {why}")
        return 0 if ok else 1
    left = leftovers(a.prefix)
    print(json.dumps(left))
    return int(any(left.values()))


if __name__ == "__main__":
    sys.exit(main())
