"""The command line as users run it: real `torchrun -m distload ...` processes.

An audit hook installed through sitecustomize (independent of distload's own counters) records, per
process, which checkpoint weight files it opened: the proof that only the reader touches storage.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from layout_oracle import serving_shards
from jobs import torchrun

AUDIT_HOOK = textwrap.dedent('''
    import os, sys
    _root = os.environ.get("AUDIT_WEIGHT_ROOT")
    _out = os.environ.get("AUDIT_OUT")
    if _root and _out:
        def _hook(event, args, _root=os.path.realpath(_root), _out=_out):
            if event == "open" and args and isinstance(args[0], str):
                path = os.path.realpath(args[0])
                if path.startswith(_root) and path.endswith((".safetensors", ".bin", ".pt")):
                    with open(os.path.join(_out, f"opens-{os.getpid()}-rank{os.environ.get('RANK', '?')}.txt"), "a") as fh:
                        fh.write(path + "\\n")
        sys.addaudithook(_hook)
''')


def test_load_tp4_save_report_and_single_reader(dense_checkpoints, tmp_path):
    from hf_models import checkpoint_tensors, read_config
    from safetensors.torch import load_file

    ckpt = dense_checkpoints["qwen2"]
    hook_dir, audit = tmp_path / "hook", tmp_path / "audit"
    hook_dir.mkdir()
    audit.mkdir()
    (hook_dir / "sitecustomize.py").write_text(AUDIT_HOOK)
    out, report_path = tmp_path / "q-tp4", tmp_path / "r.json"
    proc = torchrun(4, "load", ckpt, "--tp", "4", "--save-sharded", str(out), "--report", str(report_path),
                    env={"PYTHONPATH": str(hook_dir), "AUDIT_WEIGHT_ROOT": ckpt, "AUDIT_OUT": str(audit)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "distload: OK qwen2 world=4 tp=4" in proc.stdout

    hf, config = checkpoint_tensors(ckpt), read_config(ckpt)
    for rank in range(4):
        saved = load_file(str(out / f"rank-{rank:05d}-of-00004.safetensors"))
        want = serving_shards(hf, config, rank, 4)
        assert sorted(saved) == sorted(want)
        for name, t in want.items():
            assert torch.equal(saved[name], t), (rank, name)

    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["format"], manifest["world_size"], manifest["tp"], manifest["ep"]) == ("distload-sharded", 4, 4, 1)
    qkv = manifest["params"]["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv["style"] == "qkv" and len(qkv["ranks"]) == 4 and all(len(r["sha256"]) == 64 for r in qkv["ranks"])

    report = json.loads(report_path.read_text())
    for key in ("ok", "world_size", "tp", "ep", "readers", "checkpoint_bytes", "storage_bytes_read", "seconds",
                "per_rank", "params", "missing", "unexpected"):
        assert key in report, key
    assert report["ok"] and report["readers"] == [0]
    assert report["storage_bytes_read"] == report["checkpoint_bytes"] > 0
    assert "total" in report["seconds"] and "transfer" in report["seconds"]
    assert [r["rank"] for r in report["per_rank"]] == [0, 1, 2, 3]
    for r in report["per_rank"]:
        assert set(r) >= {"rank", "bytes_read", "bytes_received", "bytes_sent", "peak_rss_bytes", "peak_device_bytes"}
    # one process (rank 0) opened weight files; the other three never did
    opened = sorted(p.name for p in audit.iterdir())
    assert len(opened) == 1 and opened[0].endswith("rank0.txt"), opened


def test_tp3_refused_on_every_rank_with_valid_choices(dense_checkpoints):
    proc = torchrun(3, "load", dense_checkpoints["llama"], "--timeout", "60")
    assert proc.returncode != 0
    for rank in range(3):
        line = next((l for l in proc.stderr.splitlines() if l.startswith(f"distload: error on rank {rank}:")), None)
        assert line is not None, proc.stderr[-4000:]
        assert "qkv_proj.weight (rule qkv)" in line and "tp=3" in line and "try tp 1, 2, 4" in line, line


def test_a_bad_option_value_is_one_line_per_rank(dense_checkpoints):
    """argparse's refusals (a choice option's unknown value) take the form of every other bad input. (Before any
    process group exists, torchrun's agent stops the other ranks as soon as one exits: a rank stopped before it
    wrote has no line.)"""
    proc = torchrun(2, "load", dense_checkpoints["llama"], "--mtp", "bogus")
    assert proc.returncode != 0
    per_rank = [[l for l in proc.stderr.splitlines() if l.startswith(f"distload: error on rank {rank}:")]
                for rank in range(2)]
    assert any(per_rank) and all(len(lines) <= 1 for lines in per_rank), proc.stderr[-4000:]
    for line in (lines[0] for lines in per_rank if lines):
        assert "--mtp: invalid choice: 'bogus'" in line and "'include'" in line, line
        assert "distload load --help" in line, line
    assert "usage:" not in proc.stderr


def test_inspect_without_processes(dense_checkpoints):
    proc = subprocess.run([sys.executable, "-m", "distload", "inspect", dense_checkpoints["phi3"], "--tp", "4"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("family phi3: world 4, tp 4, ep 1, readers [0]")
    rows = [l.split() for l in lines if l.strip() and l.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3]
    reads = [int(r[3].replace(",", "")) for r in rows]
    assert reads[0] > 0 and reads[1:] == [0, 0, 0]   # one reader reads everything once


def test_inspect_refuses_bad_tp_before_io(dense_checkpoints):
    proc = subprocess.run([sys.executable, "-m", "distload", "inspect", dense_checkpoints["qwen3"], "--tp", "3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "try tp 1, 2, 4" in proc.stderr


def test_inspect_refuses_a_rank_outside_the_world_before_planning(dense_checkpoints):
    proc = subprocess.run([sys.executable, "-m", "distload", "inspect", dense_checkpoints["qwen3"], "--tp", "2",
                           "--world", "4", "--local-world", "2", "--rank", "4"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "--rank 4: the world has ranks 0..3" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_demo_under_torchrun(tmp_path):
    proc = torchrun(2, "demo", str(tmp_path / "demo-ckpt"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "distload: OK llama world=2 tp=2" in proc.stdout
    assert "every param loaded exactly once" in proc.stdout
    assert (tmp_path / "demo-ckpt" / "model.safetensors.index.json").exists()


def test_demo_without_a_path_leaves_no_checkpoint_behind(tmp_path):
    temp = tmp_path / "tmp"
    temp.mkdir()
    proc = torchrun(2, "demo", env={"TMPDIR": str(temp)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "distload: OK llama world=2 tp=2" in proc.stdout and "distload demo: removed " in proc.stdout
    assert not list(temp.glob("distload-demo-*")), sorted(temp.iterdir())


def test_a_load_of_several_ranks_without_torchrun_says_how_to_start_it(dense_checkpoints):
    proc = subprocess.run([sys.executable, "-m", "distload", "load", dense_checkpoints["llama"], "--tp", "2"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert ("distload: error on rank 0: --tp 2 needs 2 ranks, and this is one process that torchrun did not start "
            "(WORLD_SIZE is unset): start the job with torchrun --nproc-per-node 2 -m distload load") in proc.stderr
    assert "Traceback" not in proc.stderr


def test_two_emulated_nodes_read_once_per_job(dense_checkpoints, tmp_path):
    """Two torchrun node agents on one machine (rendezvous over loopback): one reader per node by default."""
    from spawn import free_port

    port = free_port()
    report = tmp_path / "r.json"
    procs = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", "distload-test", "-m", "distload", "load", dense_checkpoints["llama"], "--tp", "4",
               "--report", str(report), "--timeout", "60"]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env={**os.environ, "OMP_NUM_THREADS": "1"}))
    outs = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    r = json.loads(report.read_text())
    assert r["readers"] == [0, 2]                       # local rank 0 of each node
    reads = [x["bytes_read"] for x in r["per_rank"]]
    assert reads[1] == reads[3] == 0 and reads[0] > 0 and reads[2] > 0
    assert r["storage_bytes_read"] == r["checkpoint_bytes"]  # the job as a whole reads each byte once
    # rank 0 planned its node's part: the other node's column-parallel rows are not among its buckets
    import distload
    job = distload.inspect(dense_checkpoints["llama"], tp=4, world=4, local_world=2)
    assert r["plan_part"]["rank"] == 0 and 0 < r["plan_part"]["buckets"] < len(job.buckets), (r["plan_part"], len(job.buckets))


def test_process_group_is_freed_even_if_torch_distributed_nn_is_imported_later():
    """transformers' model construction imports torch.distributed.nn.functional, whose default arguments
    bind the world group: imported after the group exists, they kept it (and gloo's worker threads) alive
    past destroy_process_group, and a worker finishing during interpreter shutdown aborted a successful
    `distload verify` (SIGABRT, exit 1 under torchrun). A fresh interpreter, because an earlier test may
    have imported the module already."""
    script = textwrap.dedent("""
        import os
        import time
        import torch.distributed as dist
        from distload import topology
        topology.init_process_group(topology.from_environment())
        import torch.distributed.nn.functional
        dist.destroy_process_group()

        def gloo_threads():
            names = []
            for t in os.listdir("/proc/self/task"):
                try:
                    names.append(open(f"/proc/self/task/{t}/comm").read().strip())
                except FileNotFoundError:  # the thread ended while we looked
                    pass
            return [n for n in names if "gloo" in n]
        # A freed group's threads end soon after destroy (on a loaded machine, not at once); a pinned one's never.
        deadline = time.monotonic() + 20
        while gloo_threads() and time.monotonic() < deadline:
            time.sleep(0.1)
        print("gloo threads left:", gloo_threads())
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "gloo threads left: []" in proc.stdout, proc.stdout + proc.stderr


def test_owner_reads_under_torchrun(dense_checkpoints, tmp_path):
    """--readers owners: every rank a reader of its own pieces only (the same bytes as the default path)."""
    from hf_models import checkpoint_tensors, read_config
    from safetensors.torch import load_file

    ckpt, out, report_path = dense_checkpoints["llama"], tmp_path / "owners", tmp_path / "r.json"
    proc = torchrun(2, "load", ckpt, "--readers", "owners", "--save-sharded", str(out), "--report", str(report_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads(report_path.read_text())
    assert report["ok"] and report["readers"] == [0, 1]
    reads = [r["bytes_read"] for r in report["per_rank"]]
    assert all(0 < n < report["checkpoint_bytes"] for n in reads), reads  # each its own share, not all of it
    assert all(r["bytes_received"] == 0 for r in report["per_rank"])
    hf, config = checkpoint_tensors(ckpt), read_config(ckpt)
    for rank in range(2):
        saved = load_file(str(out / f"rank-{rank:05d}-of-00002.safetensors"))
        for name, t in serving_shards(hf, config, rank, 2).items():
            assert torch.equal(saved[name], t), (rank, name)
    bad = torchrun(1, "inspect", ckpt, "--readers", "several")
    assert bad.returncode != 0 and "choose 'per-node', 'owners'" in bad.stderr, bad.stderr[-2000:]


def test_options_refuse_a_misspelt_name_and_read_tuning_once(monkeypatch):
    """Every load option once (distload/options.py): a misspelt one is refused by name, with the closest;
    tuning comes from the environment when the options are made, and a bad value names its variable."""
    import distload
    from distload.errors import DistloadError
    from distload.options import LoadOptions, Tuning

    with pytest.raises(DistloadError, match=r"'stagng_mib' \(did you mean 'staging_mib'\?\)"):
        distload.load("/nonexistent", stagng_mib=1)
    with pytest.raises(DistloadError, match=r"'readrs' \(did you mean 'readers'\?\)"):
        LoadOptions.from_kwargs(readrs=2)
    monkeypatch.setenv("DISTLOAD_PULL", "0")
    monkeypatch.setenv("DISTLOAD_EARLY_FETCH_MIB", "0.25")
    options = LoadOptions(tp=2, expert_map=[[0, 1], [2, 3]])
    assert options.tuning == Tuning(pull=False, early_fetch_mib=0.25) and options.expert_map == ((0, 1), (2, 3))
    monkeypatch.setenv("DISTLOAD_PULL", "1")
    assert options.tuning.pull is False  # read once, when the options were made
    monkeypatch.setenv("DISTLOAD_HUGEPAGES", "yes")
    with pytest.raises(DistloadError, match="DISTLOAD_HUGEPAGES='yes'"):
        Tuning.from_environment()
