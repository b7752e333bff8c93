"""scripts/cluster.py and scripts/cluster_bench.py on 2 shaped nodes: a tiny checkpoint loads over the emulated
cluster with the bytes it should move, and nothing of the cluster is left afterwards: after a run, after an
exception inside it, after SIGTERM to its driver, and (after SIGKILL, which no process can clean up after)
once `cluster.py down` ran. No timing assertion. Skipped, with the reason, where the machine cannot emulate a
shaped cluster (not root, no network namespaces or tbf, no cgroup-v1 blkio throttle)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"
PREFIX, SUBNET = "dlt", "10.79.0"   # not the benchmark's: the test may run beside it

sys.path.insert(0, str(SCRIPTS))
try:
    import cluster
finally:
    sys.path.remove(str(SCRIPTS))

CAN, WHY = cluster.can_shape()
pytestmark = pytest.mark.skipif(not CAN, reason=f"cannot emulate a shaped cluster here: {WHY}")


def nothing_left() -> dict:
    return {k: v for k, v in cluster.leftovers(PREFIX).items() if v}


def read_ahead_kb(path: Path) -> int:
    return int(cluster.read_ahead_path(cluster.whole_disk(str(path))).read_text())


def test_a_tiny_checkpoint_loads_over_two_shaped_nodes(tmp_path):
    pytest.importorskip("fastsafetensors")
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONSAFEPATH": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPTS / "cluster_bench.py"), "--quick", "--workdir", str(tmp_path),
                           "--out", str(out), "--prefix", PREFIX, "--subnet", SUBNET,
                           "--loaders", "distload,every-rank-reads"],
                          env=env, capture_output=True, text=True, timeout=900)
    logs = "".join(p.read_text()[-3000:] for p in out.glob("log-*.txt"))
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{logs}"
    assert nothing_left() == {}
    results = json.loads((out / "results.json").read_text())
    (setting,) = results["settings"]
    assert setting["fingerprints"] == [] and not setting.get("rc")   # both loaders filled the same bytes
    shape = setting["shape"]
    assert (shape["nodes"], shape["rate"], shape["storage"], shape["read_ahead_kb"]) == (2, "400mbit", "shared", 128)
    rows = {s["loader"]: s for s in results["summary"]}
    assert set(rows) == {"distload", "every-rank-reads"} and not any(s["errors"] for s in rows.values())
    ckpt = rows["distload"]["checkpoint_bytes"]
    # distload reads the checkpoint once for the job and sends over its link what the plan says the other node
    # keeps (the predictor's payload; the link counts frames, and the job's few control messages);
    # every-rank-reads reads on both nodes and sends nothing but those
    assert ckpt <= rows["distload"]["storage_bytes"] < 1.5 * ckpt
    assert rows["every-rank-reads"]["storage_bytes"] > rows["distload"]["storage_bytes"]
    payload = rows["distload"]["predicted"]["nic_bytes_max"]
    assert payload > 0 and payload <= rows["distload"]["link_bytes_max"] < 1.2 * payload + (256 << 10)
    assert rows["every-rank-reads"]["link_bytes_max"] < 256 << 10
    for s in rows.values():   # each row beside its byte-count time and the predictor's
        assert s["by_bytes_s"] > 0 and s["predicted"]["seconds"] > 0 and s["predicted"]["resource"] == "storage"
    assert "| 2 x 1 | shared | 128 KiB | distload |" in (out / "results.md").read_text()


DRIVER = """
import sys, time
sys.path.insert(0, {scripts!r})
import cluster
with cluster.Cluster(2, storage="per-node", read_ahead_kb=128, data={data!r}, prefix={prefix!r}, subnet={subnet!r}) as c:
    for i in range(c.nodes):
        c.popen(i, ["sleep", "300"])   # node processes that would outlive the driver
    def sleeping(i):   # the node's sleep has started (its mounts, run as children of a shell, are done)
        names = []
        for pid in cluster.sh("ip", "netns", "pids", c.ns(i)).stdout.split():
            try:
                names.append(open("/proc/%s/comm" % pid).read().strip())
            except OSError:   # a mount that just ended
                pass
        return names == ["sleep"]
    while not all(sleeping(i) for i in range(c.nodes)):
        time.sleep(0.05)
    print("up", flush=True)
    if sys.argv[1] == "raise":
        sys.stdin.readline()
        raise RuntimeError("boom")
    time.sleep(300)
"""


@pytest.mark.parametrize("how", ["raise", "SIGTERM", "SIGKILL"])
def test_nothing_is_left_after_a_failed_or_killed_run(tmp_path, how):
    before = read_ahead_kb(tmp_path)
    script = DRIVER.format(scripts=str(SCRIPTS), data=str(tmp_path), prefix=PREFIX, subnet=SUBNET)
    proc = subprocess.Popen([sys.executable, "-c", script, how], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up", proc.stderr.read()
        up = cluster.leftovers(PREFIX)
        assert len(up["netns"]) == 3 and len(up["cgroups"]) == 3 and up["read_ahead_to_restore"]
        assert read_ahead_kb(tmp_path) == 128
        on_nodes = [pid for ns in up["netns"] for pid in cluster.sh("ip", "netns", "pids", ns).stdout.split()]
        assert len(on_nodes) == 2, on_nodes
        if how == "raise":
            proc.stdin.write("go\n")
            proc.stdin.flush()
        else:
            proc.send_signal(getattr(signal, how))
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:   # the test failed with the driver up: leave nothing for the next test either
            proc.kill()
            proc.wait()
            cluster.teardown(PREFIX)
    if how == "SIGKILL":   # nothing runs after SIGKILL: what it left is still there, for `down`
        assert nothing_left()
        subprocess.run([sys.executable, str(SCRIPTS / "cluster.py"), "down", "--prefix", PREFIX], check=True,
                       timeout=60)
    else:
        assert proc.returncode == (1 if how == "raise" else 128 + signal.SIGTERM), proc.stderr.read()
    assert nothing_left() == {}
    assert read_ahead_kb(tmp_path) == before
    assert [pid for pid in on_nodes if alive(int(pid))] == []


def alive(pid: int) -> bool:
    """Is `pid` still a running process (not gone, not a zombie waiting for its parent)?"""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
