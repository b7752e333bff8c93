"""Training-to-serving handoff on real gloo ranks: sharded saves reload rank-locally (or re-cut with
--reshard), interrupted saves never damage an earlier one, live refit, and DCP input.

The reference is independent of distload: `transformers` saved the checkpoints, `safetensors` reads them
back, tests/layout_oracle.py slices them into what each rank must hold; every comparison is torch.equal.
An audit hook (as in test_load_e2e.py) records which weight files each process opens.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch

from checks import differences
from spawn import run_ranks

WEIGHT_SUFFIXES = (".safetensors", ".distcp")


def _record_opens(root):
    """Every weight file under `root` this process opens from now on (an audit hook, not distload's counters)."""
    opened, root = [], str(Path(root).resolve()) + os.sep

    def hook(event, args):
        if event == "open" and args and isinstance(args[0], (str, bytes)):
            path = args[0].decode() if isinstance(args[0], bytes) else args[0]
            if path.endswith(WEIGHT_SUFFIXES) and str(Path(path).resolve()).startswith(root):
                opened.append(Path(path).name)
    sys.addaudithook(hook)
    return opened


def _oracle(path: str, tp_rank: int, tp: int, ep: int = 1) -> dict:
    from hf_models import checkpoint_tensors, read_config
    from layout_oracle import serving_shards

    return serving_shards(checkpoint_tensors(path), read_config(path), tp_rank, tp, ep_size=ep)


def _refusal(fn) -> str:
    """The message of the DistloadError `fn` raises ('' if it does not raise)."""
    import distload

    try:
        fn()
    except distload.DistloadError as exc:
        return str(exc)
    return ""


# ----------------------------------------------------------------------------------------------------
# Save, reload, reshard: three process groups (2 ranks, then 4, then 2), many cases each


def _on_two_ranks_first(ckpts: dict, saves: str, dcp_single: str, dcp_root: str) -> dict:
    """tp 2: save + exact reload; DCP (single-process save, and a 2-rank FSDP-style Shard(0) save) -> tp 2."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor

    import distload
    from hf_models import checkpoint_tensors

    rank = dist.get_rank()
    problems = []
    for fam in ("llama", "qwen2"):
        out = Path(saves) / f"{fam}-w2"
        distload.load(ckpts[fam], tp=2, save_sharded=str(out), progress=False)
        opened = _record_opens(out)
        again = distload.load(str(out), progress=False)
        problems += differences(again.params, _oracle(ckpts[fam], rank, 2), f"{fam} reload w2 rank{rank}")
        if sorted(set(opened)) != [f"rank-{rank:05d}-of-00002.safetensors"]:
            problems.append(f"{fam} reload w2 rank{rank} opened {sorted(set(opened))}")

    # A 2-rank DCP save the way FSDP2 shards: every tensor split on dim 0 across the ranks (uneven splits too).
    mesh = DeviceMesh("cpu", [0, 1])
    sharded = {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in checkpoint_tensors(ckpts["qwen3"]).items()}
    dcp_sharded = Path(dcp_root) / "qwen3-fsdp"
    dcp.save(sharded, checkpoint_id=str(dcp_sharded))
    reports = {}
    for label, path, fam in (("single", dcp_single, "llama"), ("fsdp", str(dcp_sharded), "qwen3")):
        opened = _record_opens(path)
        result = distload.load(path, tp=2, hf_config=ckpts[fam], progress=False)
        problems += differences(result.params, _oracle(ckpts[fam], rank, 2), f"dcp {label} rank{rank}")
        reports[label] = (result.report, sorted(set(opened)))
    return {"problems": problems, "dcp": reports}


def _on_four_ranks(ckpts: dict, saves: str) -> dict:
    """tp 4: save + reload opening only the own rank file; 2 -> 4 reshard; mismatch refused; checksums."""
    import torch.distributed as dist

    import distload

    rank = dist.get_rank()
    problems = []
    out = Path(saves) / "llama-w4"
    distload.load(ckpts["llama"], tp=4, save_sharded=str(out), progress=False)
    opened = _record_opens(out)
    again = distload.load(str(out), progress=False)
    problems += differences(again.params, _oracle(ckpts["llama"], rank, 4), f"reload w4 rank{rank}")
    own = sorted(set(opened))

    resharded = distload.load(str(Path(saves) / "llama-w2"), tp=4, reshard=True, progress=False)
    problems += differences(resharded.params, _oracle(ckpts["llama"], rank, 4), f"reshard 2->4 rank{rank}")
    qwen = distload.load(str(Path(saves) / "qwen2-w2"), tp=4, reshard=True, progress=False)
    problems += differences(qwen.params, _oracle(ckpts["qwen2"], rank, 4), f"qwen2 reshard 2->4 rank{rank}")
    # world 4, tp 2: two data-parallel replicas of the tp-2 layout
    replicas = distload.load(str(out), tp=2, reshard=True, progress=False)
    problems += differences(replicas.params, _oracle(ckpts["llama"], rank % 2, 2), f"reshard w4tp4->w4tp2 rank{rank}")

    # experts: tp 4 inside ep 2 groups, saved and reloaded in place
    moe = Path(saves) / "mixtral-w4"
    distload.load(ckpts["mixtral"], tp=4, ep=2, save_sharded=str(moe), progress=False)
    again_moe = distload.load(str(moe), ep=2, progress=False)
    problems += differences(again_moe.params, _oracle(ckpts["mixtral"], rank, 4, ep=2), f"moe reload w4 rank{rank}")

    refused = _refusal(lambda: distload.load(str(Path(saves) / "llama-w2"), tp=4, progress=False))
    return {"problems": problems, "own": own, "report": again.report, "reshard_report": resharded.report,
            "refused": refused}


def _on_two_ranks_again(ckpts: dict, saves: str) -> dict:
    """4 -> 2: refused without --reshard (naming both topologies, before any weight byte), exact with it."""
    import torch.distributed as dist

    import distload

    rank = dist.get_rank()
    out = Path(saves) / "llama-w4"
    opened = _record_opens(out)
    refused = _refusal(lambda: distload.load(str(out), progress=False))
    opened_before_refusal = sorted(set(opened))
    result = distload.load(str(out), reshard=True, progress=False)
    problems = differences(result.params, _oracle(ckpts["llama"], rank, 2), f"reshard 4->2 rank{rank}")
    for ep in (1, 2):  # experts saved at tp 4 / ep 2, re-cut to 2 ranks: TP-split experts, or 2 whole ones each
        moe = distload.load(str(Path(saves) / "mixtral-w4"), ep=ep, reshard=True, progress=False)
        problems += differences(moe.params, _oracle(ckpts["mixtral"], rank, 2, ep=ep), f"moe 4->2 ep{ep} rank{rank}")

    # A damaged byte: the checksum catches it on the rank that reads that file, and every rank fails together.
    corrupt = Path(saves) / "llama-w2-corrupt"
    if rank == 0:
        import shutil

        shutil.copytree(Path(saves) / "llama-w2", corrupt)
        manifest = json.loads((corrupt / "manifest.json").read_text())
        offset = manifest["params"]["model.layers.0.self_attn.o_proj.weight"]["ranks"][1]["offset"]
        with open(corrupt / "rank-00001-of-00002.safetensors", "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    corrupt_refused = _refusal(lambda: distload.load(str(corrupt), progress=False))
    unchecked = distload.load(str(corrupt), checksums=False, progress=False)
    return {"problems": problems, "refused": refused, "opened_before_refusal": opened_before_refusal,
            "report": result.report, "corrupt": corrupt_refused, "unchecked_ok": unchecked.report["ok"]}


def test_save_reload_reshard_dcp(dense_checkpoints, tmp_path):
    import torch.distributed.checkpoint as dcp

    from hf_models import build_model, save_checkpoint

    ckpts = {**dense_checkpoints, "mixtral": str(save_checkpoint("mixtral", tmp_path / "mixtral"))}
    saves = tmp_path / "saves"
    # A single-process DCP save of an app state, as trainers write it: the model under "model", plus a counter.
    dcp_single = tmp_path / "dcp" / "llama-single"
    model = build_model("llama")
    dcp.save({"model": model.state_dict(), "step": 7}, checkpoint_id=str(dcp_single))

    first = run_ranks(2, _on_two_ranks_first, ckpts, str(saves), str(dcp_single), str(tmp_path / "dcp"))
    problems = [p for r in first for p in r["problems"]]
    assert not problems, "\n".join(problems)
    manifest = json.loads((saves / "llama-w2" / "manifest.json").read_text())
    assert (manifest["world_size"], manifest["tp"], manifest["ep"]) == (2, 2, 1)
    assert manifest["params"]["model.norm.weight"]["ranks"][1]["sha256"]
    for label in ("single", "fsdp"):
        report, opened = first[0]["dcp"][label]
        # each chunk byte read once, by the one reader (rank 0); rank 1 opened no .distcp file
        assert report["ok"] and report["storage_bytes_read"] == report["checkpoint_bytes"], label
        assert report["per_rank"][1]["bytes_read"] == 0 and not first[1]["dcp"][label][1], label
        assert opened, label
    # the single-process save wrapped the model under "model." and held a non-tensor entry: both handled
    assert first[0]["dcp"]["single"][0]["params"] > 0

    four = run_ranks(4, _on_four_ranks, ckpts, str(saves))
    problems = [p for r in four for p in r["problems"]]
    assert not problems, "\n".join(problems)
    # each of the 4 processes opened exactly its own rank file, and read exactly its own file's tensor bytes
    assert [r["own"] for r in four] == [[f"rank-{r:05d}-of-00004.safetensors"] for r in range(4)]
    report = four[0]["report"]
    sizes = [_tensor_bytes(saves / "llama-w4" / f"rank-{r:05d}-of-00004.safetensors") for r in range(4)]
    assert [p["bytes_read"] for p in report["per_rank"]] == sizes
    assert all(p["bytes_received"] == 0 and p["bytes_sent"] == 0 for p in report["per_rank"])
    assert report["ok"] and not report["resharded"] and all(p["checksums_verified"] > 0 for p in report["per_rank"])
    assert four[0]["reshard_report"]["resharded"] and four[0]["reshard_report"]["ok"]
    refused = {r["refused"] for r in four}
    assert len(refused) == 1, refused
    assert "saved with world 2, tp 2, ep 1; this job has world 4, tp 4, ep 1" in refused.pop()

    again = run_ranks(2, _on_two_ranks_again, ckpts, str(saves))
    problems = [p for r in again for p in r["problems"]]
    assert not problems, "\n".join(problems)
    messages = {r["refused"] for r in again}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert "saved with world 4, tp 4, ep 1; this job has world 2, tp 2, ep 1" in message
    assert "--reshard" in message and "4 ranks" in message
    assert all(r["opened_before_refusal"] == [] for r in again), "a weight file was opened before the refusal"
    assert again[0]["report"]["ok"] and again[0]["report"]["resharded"]
    # rank 1 (which read the file) names the tensor; rank 0 learns it from the agreement step
    assert all("checksum mismatch" in r["corrupt"] and "o_proj.weight" in r["corrupt"] for r in again), again
    assert all(r["unchecked_ok"] for r in again)


def _tensor_bytes(path: Path) -> int:
    from safetensors.torch import load_file

    return sum(t.numel() * t.element_size() for t in load_file(str(path)).values())


# ----------------------------------------------------------------------------------------------------
# Interrupted saves: a rank SIGKILLed during the save


def _save_then_die(ckpt_a: str, ckpt_b: str, out: str, victim: int, when: str) -> None:
    """Optionally make a first complete save of A; then save B, with `victim` SIGKILLing itself when it opens
    `when` inside the temporary directory (its rank file: mid-write; the manifest: at the commit)."""
    import torch.distributed as dist

    import distload

    if ckpt_a:
        distload.load(ckpt_a, tp=2, save_sharded=out, progress=False)
    if dist.get_rank() == victim:
        def hook(event, args):
            if event == "open" and args and isinstance(args[0], str) and ".tmp-" in args[0] \
                    and os.path.basename(args[0]) == when:
                os.kill(os.getpid(), signal.SIGKILL)
        sys.addaudithook(hook)
    distload.load(ckpt_b, tp=2, save_sharded=out, progress=False)


def _victim_entry(rank: int, world: int, store_file: str, fn, args, queue) -> None:
    import traceback

    import torch.distributed as dist
    import torch.distributed.nn.functional  # noqa: F401  (before the group: see topology.init_process_group)

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      GROUP_RANK="0", CUDA_VISIBLE_DEVICES="")
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
        fn(*args)
        queue.put((rank, "ok"))
    except BaseException as exc:
        queue.put((rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _run_with_a_victim(world: int, fn, *args, timeout: float = 180.0) -> dict[int, str]:
    """Like spawn.run_ranks, for jobs where a rank dies: per rank 'killed', 'ok', or the error it raised."""
    import queue as queues
    import tempfile
    import time

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store = os.path.join(tempfile.mkdtemp(prefix="distload-victim-"), "store")
    procs = [ctx.Process(target=_victim_entry, args=(r, world, store, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    outcome, deadline = {}, time.monotonic() + timeout

    def drain(wait: float) -> None:
        try:  # while they run too: a child blocked on a full queue would never exit
            while True:
                rank, what = queue.get(timeout=wait)
                outcome[rank] = what
        except queues.Empty:
            pass
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        drain(0.5)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    drain(0.5)
    for r, p in enumerate(procs):
        if p.exitcode == -signal.SIGKILL:
            outcome[r] = "killed"
    return outcome


def _reload_and_resave(ckpt_a: str, ckpt_b: str, out: str, leftover: str) -> list[str]:
    import torch.distributed as dist

    import distload

    rank = dist.get_rank()
    result = distload.load(out, progress=False)
    problems = differences(result.params, _oracle(ckpt_a, rank, 2), f"earlier save after the kills, rank {rank}")
    refused = _refusal(lambda: distload.load(leftover, progress=False))
    if "interrupted" not in refused:
        problems.append(f"loading the leftover {leftover} was not refused as interrupted: {refused!r}")
    distload.load(ckpt_b, tp=2, save_sharded=out, progress=False)
    result = distload.load(out, progress=False)
    problems += differences(result.params, _oracle(ckpt_b, rank, 2), f"save after the kills, rank {rank}")
    return problems


def test_interrupted_save_leaves_the_earlier_one_intact(dense_checkpoints, tmp_path):
    from hf_models import save_checkpoint

    ckpt_a = dense_checkpoints["llama"]
    ckpt_b = str(save_checkpoint("llama", tmp_path / "llama-b", seed=1))
    out = tmp_path / "out"
    # rank 1 dies as it starts writing its rank file; rank 0 learns it at the agreement step and cleans up
    outcome = _run_with_a_victim(2, _save_then_die, ckpt_a, ckpt_b, str(out), 1, "rank-00001-of-00002.safetensors")
    assert outcome[1] == "killed" and outcome[0] != "ok", outcome
    manifest = (out / "manifest.json").read_text()
    assert json.loads(manifest)["source_checkpoint"] == str(Path(ckpt_a).absolute())
    # rank 0 dies at the commit, after every rank file was written: nobody cleans up
    outcome = _run_with_a_victim(2, _save_then_die, "", ckpt_b, str(out), 0, "manifest.json.part")
    assert outcome[0] == "killed" and outcome[1] != "ok", outcome
    assert (out / "manifest.json").read_text() == manifest, "the earlier save changed"
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")]
    assert len(leftovers) == 1 and not (leftovers[0] / "manifest.json").exists(), leftovers
    assert sorted(p.name for p in leftovers[0].iterdir()) == [f"rank-0000{r}-of-00002.safetensors" for r in (0, 1)]

    problems = run_ranks(2, _reload_and_resave, ckpt_a, ckpt_b, str(out), str(leftovers[0]))
    assert not [p for r in problems for p in r], "\n".join(p for r in problems for p in r)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")], "stale temporary directories remain"


def test_save_refuses_to_replace_a_foreign_directory(dense_checkpoints, tmp_path):
    from distload.errors import CheckpointError
    from distload.sharded.save import prepare_directory

    foreign = tmp_path / "precious"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not a distload save"):
        prepare_directory(foreign, tmp_path / ".precious.tmp-x")
    assert (foreign / "notes.txt").read_text() == "mine"


# ----------------------------------------------------------------------------------------------------
# Live refit


def _refit_cases(ckpt: str, changed: str) -> dict:
    import torch.distributed as dist

    import distload
    from hf_models import checkpoint_tensors

    rank = dist.get_rank()
    src = 1  # not the load's reader: any rank may push
    result = distload.load(ckpt, tp=2, progress=False)
    new = checkpoint_tensors(changed) if rank == src else None
    problems = []
    done = distload.refit(result, new, src=src)
    problems += differences(result.params, _oracle(changed, rank, 2), f"refit rank{rank}")
    if (done.version, result.version) != (1, 1):
        problems.append(f"version after the first refit: {done.version}, {result.version}")
    before = {n: t.clone() for n, t in result.params.items()}

    def push(tensors, **kw):
        return _refusal(lambda: distload.refit(result, tensors if rank == src else None, src=src, **kw))

    def changed_tensors(**edits):
        out = dict(new) if rank == src else {}
        for name, value in edits.items():
            if value is None:
                out.pop(name, None)
            else:
                out[name] = value
        return out

    refusals = {}
    if rank == src:
        grown = torch.cat([new["model.layers.1.mlp.gate_proj.weight"]] * 2)
        half = new["model.norm.weight"].to(torch.bfloat16)
    else:
        grown = half = None
    refusals["shape"] = push(changed_tensors(**{"model.layers.1.mlp.gate_proj.weight": grown,
                                                "model.layers.1.mlp.up_proj.weight": grown}))
    refusals["dtype"] = push(changed_tensors(**{"model.norm.weight": half}))
    refusals["unknown"] = push(changed_tensors(**{"model.layers.0.mlp.extra.weight": half}))
    refusals["missing"] = push(changed_tensors(**{"lm_head.weight": None}))
    refusals["fused part"] = push(changed_tensors(**{"model.layers.1.mlp.up_proj.weight": None}), partial=True)
    refusals["version"] = push(changed_tensors(), version=1)
    result.version = 5 if rank == 1 else 1   # rank 1 as if it had taken an update the others missed
    refusals["versions differ"] = push(changed_tensors())
    result.version = 1
    for name, t in result.params.items():
        if not torch.equal(t, before[name]):
            problems.append(f"rank {rank}: {name} changed by a refused refit")
    if result.version != 1:
        problems.append(f"a refused refit moved the version to {result.version}")

    # A partial update (one param), then a refit into a plain dict of params (config and tp given).
    norm = {"model.norm.weight": torch.full((64,), 3.0)} if rank == src else None
    done = distload.refit(result, norm, src=src, partial=True)
    if done.version != 2 or not torch.equal(result.params["model.norm.weight"], torch.full((64,), 3.0)):
        problems.append(f"rank {rank}: partial refit did not land (version {done.version})")
    plain = {n: torch.zeros_like(t) for n, t in result.params.items()}
    done = distload.refit(plain, checkpoint_tensors(ckpt) if rank == src else None, src=src, config=ckpt, tp=2, version=7)
    problems += differences(plain, {n: t for n, t in _oracle(ckpt, rank, 2).items()}, f"refit into a dict rank{rank}")
    problems += _refit_one_layer(plain, changed, ckpt, rank, src)
    return {"problems": problems, "refusals": refusals, "version": done.version, "report": done.report}


def _refit_one_layer(params: dict, changed: str, ckpt: str, rank: int, src: int) -> list[str]:
    """A partial refit of exactly layer 1's tensors from `changed` into `params` (a load of `ckpt`): layer 1 is
    then a fresh load of `changed`'s, every other param bitwise what it was."""
    import distload
    from hf_models import checkpoint_tensors

    layer = "model.layers.1."
    before = {n: t.clone() for n, t in params.items()}
    sent = {n: t for n, t in checkpoint_tensors(changed).items() if n.startswith(layer)} if rank == src else None
    distload.refit(params, sent, src=src, config=ckpt, tp=2, partial=True)
    fresh = _oracle(changed, rank, 2)
    mine = sorted(n for n in fresh if n.startswith(layer))
    problems = differences({n: t for n, t in params.items() if n.startswith(layer)}, {n: fresh[n] for n in mine},
                           f"layer refit rank{rank}")
    if all(torch.equal(fresh[n], before[n]) for n in mine):
        problems.append(f"rank {rank}: the changed checkpoint's layer 1 equals the original's: nothing was tested")
    problems += [f"rank {rank}: {n} changed by a refit of layer 1 only" for n, t in params.items()
                 if not n.startswith(layer) and not torch.equal(t, before[n])]
    return problems


def test_refit(dense_checkpoints, tmp_path):
    from hf_models import save_checkpoint

    changed = str(save_checkpoint("llama", tmp_path / "llama-step2", seed=2))
    results = run_ranks(2, _refit_cases, dense_checkpoints["llama"], changed)
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)
    for case, words in {"shape": ["gate_up_proj.weight", "gate_proj.weight has 256 rows", "intermediate = 128"],
                        "dtype": ["model.norm.weight", "BF16", "F32"],
                        "unknown": ["model.layers.0.mlp.extra.weight"],
                        "missing": ["lm_head.weight", "partial=True"],
                        "fused part": ["model.layers.1.mlp.gate_up_proj.weight", "from 'model.layers.1.mlp.gate_proj",
                                       "without 'model.layers.1.mlp.up_proj", "send all parts of a fused param"],
                        "version": ["version 1", "not newer"]}.items():
        messages = {r["refusals"][case] for r in results}
        assert len(messages) == 1, (case, messages)  # the same refusal on every rank
        message = messages.pop()
        assert all(w in message for w in words), (case, message)
    for rank, r in enumerate(results):   # one all-reduce finds it; each rank names its own version
        assert f"different versions, from 1 to 5 (this rank: {5 if rank == 1 else 1};" in r["refusals"]["versions differ"]
    assert [r["version"] for r in results] == [7, 7]
    per_rank = results[0]["report"]["per_rank"]
    assert per_rank[0]["bytes_received"] > 0 and per_rank[1]["bytes_received"] == 0  # src keeps its own share


# ----------------------------------------------------------------------------------------------------
# DCP input: what is refused, without processes


class _Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_dcp_metadata_pickle_cannot_run_code(tmp_path):
    import pickle

    from distload.checkpoint.dcp import read_metadata
    from distload.errors import CheckpointError

    marker = tmp_path / "ran"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    with pytest.raises(CheckpointError, match="refusing to unpickle posix.system"):
        read_metadata(str(tmp_path))
    assert not marker.exists()


def test_dcp_strided_chunk_refused(dense_checkpoints, tmp_path):
    import torch.distributed.checkpoint as dcp

    from distload.checkpoint.dcp import discover_dcp
    from distload.errors import CheckpointError
    from hf_models import checkpoint_tensors

    tensors = checkpoint_tensors(dense_checkpoints["llama"])
    name = "model.layers.0.self_attn.o_proj.weight"
    tensors[name] = tensors[name].t().contiguous().t()  # same values, column-major storage
    dcp.save(tensors, checkpoint_id=str(tmp_path / "dcp"))
    with pytest.raises(CheckpointError, match=f"{name}.*strides"):
        discover_dcp(str(tmp_path / "dcp"), dense_checkpoints["llama"])
