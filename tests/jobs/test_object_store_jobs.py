"""`torchrun -m distload load s3://...` against a real S3 server (moto, tests/support/s3_server.py) started here:
faults on the wire (503 SlowDown and 500, a reset and a short body mid-body, an object overwritten mid-load),
refusals (a missing key, a wrong bucket, no credentials, access denied), the node cache (a second load fetches no
weight byte; a changed object is fetched again) and the bandwidth cap, each a real job of 2 ranks. Every job ends,
a refusal with one `distload: error on rank R:` line per rank naming the URL and the fix, and no credential ever
appears in what a job prints or reports; a refused job leaves no --save-sharded and only whole ranges cached."""

from __future__ import annotations

import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from jobs import torchrun_job
from s3_checks import header_bytes

BUCKET = "jobs-bucket"
NPROC = 2
DATA = r"^bytes=(?!0-7$|8-)\d+-"   # a weight range, not one of discovery's header GETs
ERROR_LINE = re.compile(r"^distload: error on rank (\d+): (.*)$", re.M)
SPAN = re.compile(r"([0-9a-f]{16})-([0-9a-f]{16})")


@dataclass
class Job:
    """One job: its prefix (each its own), what is done to the server first, the flags, and its environment."""
    id: str
    prepare: object = None                   # prepare(server, job, ws) before the job starts
    flags: list = field(default_factory=list)
    url: str | None = None                   # default: s3://BUCKET/<id>
    env: object = None                       # env(server) -> the job's environment (default: server.env())
    after: str | None = None                 # runs after this job (it uses what that one left)
    cache: str | None = None                 # --cache-dir, a folder shared by the jobs that name it


def _faults(*rules):
    def prepare(server, job, ws):
        for action, kw in rules:
            server.faults.add(action, key=rf"^{job.id}/.*\.safetensors$", range=DATA, **kw)
    return prepare


def _overwrite_mid_load(server, job, ws):
    victim = f"{job.id}/model-00002-of-00005.safetensors"
    changed = _changed_file(ws / "base" / "model-00002-of-00005.safetensors", ws / "changed.safetensors")
    server.faults.add("call", key=f"^{victim}$", range=DATA,
                      fn=lambda e: server.client().upload_file(str(changed), BUCKET, victim))


def _delete_one(server, job, ws):
    server.client().delete_object(Bucket=BUCKET, Key=f"{job.id}/model-00003-of-00005.safetensors")


def _change_one(server, job, ws):
    """The object changed on the server since the cache was filled (the same header, other values)."""
    key = "cached/model-00002-of-00005.safetensors"
    changed = _changed_file(ws / "base" / "model-00002-of-00005.safetensors", ws / "changed.safetensors")
    server.client().upload_file(str(changed), BUCKET, key)


def _changed_file(src: Path, out: Path) -> Path:
    from safetensors.torch import load_file, save_file

    save_file({n: t + 1 for n, t in load_file(src).items()}, str(out), metadata={"format": "pt"})
    return out


def _no_credentials(server):
    env = server.env()
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        env.pop(k)
    return {**env, "HOME": "/nonexistent-home"}


JOBS = [
    Job("cached", flags=["--save-sharded", "{ws}/out"], cache="node"),
    Job("cached-again", url=f"s3://{BUCKET}/cached", flags=["--save-sharded", "{ws}/out"], after="cached",
        cache="node"),
    Job("cached-changed", url=f"s3://{BUCKET}/cached", after="cached-again", prepare=_change_one, cache="node",
        flags=["--save-sharded", "{ws}/out"]),
    Job("retried", prepare=_faults(("503", dict(times=2)), ("500", dict(skip=3, times=2))),
        flags=["--save-sharded", "{ws}/out"]),
    Job("reset", prepare=_faults(("reset", dict(skip=1, after_bytes=1000))), flags=["--save-sharded", "{ws}/out"]),
    Job("short", prepare=_faults(("short", dict(skip=2, after_bytes=777))), flags=["--save-sharded", "{ws}/out"]),
    Job("short-always", prepare=_faults(("short", dict(times=10**6, after_bytes=100))),
        flags=["--save-sharded", "{ws}/out"], cache="short-always"),
    Job("overwritten", prepare=_overwrite_mid_load, flags=["--save-sharded", "{ws}/out"], cache="overwritten"),
    Job("missing-key", prepare=_delete_one),
    Job("wrong-bucket", url="s3://no-such-bucket-here/llama"),
    Job("no-credentials", env=_no_credentials),
    Job("capped", flags=["--max-gbps", "0.002"]),
]
AUTH_JOBS = [Job("access-denied", url=f"s3://{BUCKET}/llama"), Job("wrong-secret", url=f"s3://{BUCKET}/llama")]


@pytest.fixture(scope="module")
def server():
    from s3_server import S3Server

    with S3Server() as s3:
        yield s3
        s3.enforce_auth(False)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from hf_models import save_checkpoint

    return save_checkpoint("llama", tmp_path_factory.mktemp("s3-jobs") / "base")


def _run(server, job: Job, base: Path, root: Path, env: dict) -> dict:
    ws = root / job.id
    ws.mkdir()
    shutil.copytree(base, ws / "base")
    if job.url is None:
        server.upload(base, BUCKET, job.id)
    start = len(server.log.entries)   # the job's requests are those after (other jobs': other prefixes)
    if job.prepare is not None:
        job.prepare(server, job, ws)
    flags = [f.format(ws=ws) for f in job.flags]
    if job.cache:
        flags += ["--cache-dir", str(root / f"cache-{job.cache}")]
    args = ["load", job.url or f"s3://{BUCKET}/{job.id}", "--tp", str(NPROC), "--staging-mib", "0.0625",
            "--timeout", "30", "--no-progress", "--report", str(ws / "report.json"), *flags]
    proc = torchrun_job(NPROC, args, env, cwd=ws)
    report = json.loads((ws / "report.json").read_text()) if (ws / "report.json").exists() else None
    return {"rc": proc.returncode, "output": proc.stdout, "report": report, "ws": ws,
            "log": server.log.entries[start:]}


@pytest.fixture(scope="module")
def outcomes(server, base, tmp_path_factory):
    """Every job: those without auth 3 at a time (a chain waits for the job before it), then, with moto's IAM
    enforced, those about credentials."""
    root = tmp_path_factory.mktemp("s3-job-runs")
    server.upload(base, BUCKET, "llama")
    results, futures = {}, {}
    with ThreadPoolExecutor(3) as pool:
        def chain(first: Job):
            out = {first.id: _run(server, first, base, root, first.env(server) if first.env else server.env())}
            for job in (j for j in JOBS if j.after == first.id):
                out.update(chain(job))
            return out
        for job in JOBS:
            if job.after is None:
                futures[job.id] = pool.submit(chain, job)
        for fut in futures.values():
            results.update(fut.result())
    reader = server.user("reader", ["s3:ListBucket", "s3:GetObject"])
    lister = server.user("lister", ["s3:ListBucket"])
    server.enforce_auth(True)
    try:
        envs = {"access-denied": server.env(*lister), "wrong-secret": server.env(reader[0], "not-the-secret-" * 3)}
        for job in AUTH_JOBS:
            results[job.id] = _run(server, job, base, root, envs[job.id])
    finally:
        server.enforce_auth(False)
    results["secrets"] = [s for pair in (reader, lister) for s in pair] + ["not-the-secret-" * 3]
    return results


def _lines(o: dict) -> dict[int, list[str]]:
    lines: dict[int, list[str]] = {}
    for rank, message in ERROR_LINE.findall(o["output"]):
        lines.setdefault(int(rank), []).append(message)
    return lines


def _describe(o: dict) -> str:
    return f"rc={o['rc']}\n{o['output'][-5000:]}"


def _saved(directory: Path) -> dict:
    from safetensors.torch import load_file

    return {p.name: load_file(p) for p in sorted(directory.glob("rank-*.safetensors"))}


_REFERENCES: dict[str, dict] = {}   # checkpoint directory -> what its load saves (one job per directory)


def _same_as_directory_load(o: dict, checkpoint: Path, tmp: Path) -> None:
    """The job's --save-sharded holds exactly what the same load of the directory saves."""
    if str(checkpoint) not in _REFERENCES:
        ref = tmp / "ref"
        proc = torchrun_job(NPROC, ["load", str(checkpoint), "--tp", str(NPROC), "--no-progress", "--save-sharded",
                                    str(ref)], {})
        assert proc.returncode == 0, proc.stdout
        _REFERENCES[str(checkpoint)] = _saved(ref)
    got, want = _saved(o["ws"] / "out"), _REFERENCES[str(checkpoint)]
    assert sorted(got) == sorted(want) and got
    for f in want:
        assert sorted(got[f]) == sorted(want[f]) and all(torch.equal(got[f][n], want[f][n]) for n in want[f]), f


def _cache_is_whole(folder: Path) -> list[Path]:
    """Every file of the cache is a whole range: named by its span, of that size; no temporary file left."""
    files = [p for p in folder.rglob("*") if p.is_file()] if folder.exists() else []
    for p in files:
        m = SPAN.fullmatch(p.name)
        assert m and p.stat().st_size == int(m.group(2), 16) - int(m.group(1), 16), p
    return files


OK_JOBS = ["cached", "cached-again", "cached-changed", "retried", "reset", "short", "capped"]
REFUSED = {   # job -> what every rank's message must name
    "short-always": [f"s3://{BUCKET}/short-always/model-", "broke off", "nothing short was kept"],
    "overwritten": [f"s3://{BUCKET}/overwritten/model-00002-of-00005.safetensors", "changed on the server",
                    "ETag"],
    "missing-key": [f"s3://{BUCKET}/missing-key/model-00003-of-00005.safetensors", "is missing", "upload"],
    "wrong-bucket": ["s3://no-such-bucket-here/llama", "bucket 'no-such-bucket-here' does not exist",
                     "check the bucket"],
    "no-credentials": [f"s3://{BUCKET}/no-credentials", "no AWS credentials", "AWS_ACCESS_KEY_ID"],
    "access-denied": [f"s3://{BUCKET}/llama/", "access denied", "s3:GetObject"],
    "wrong-secret": [f"s3://{BUCKET}/llama", "secret access key does not match", "AWS_SECRET_ACCESS_KEY"],
}


@pytest.mark.parametrize("job_id", OK_JOBS)
def test_loads(outcomes, job_id):
    o = outcomes[job_id]
    assert o["rc"] == 0, _describe(o)
    assert o["report"]["ok"] and "distload: OK" in o["output"], _describe(o)


@pytest.mark.parametrize("job_id", sorted(REFUSED))
def test_refused_on_every_rank_naming_the_url_and_the_fix(outcomes, job_id):
    o = outcomes[job_id]
    assert o["rc"] not in (0, None), _describe(o)
    lines = _lines(o)
    assert sorted(lines) == list(range(NPROC)) and all(len(m) == 1 for m in lines.values()), _describe(o)
    for [message] in lines.values():
        for needle in REFUSED[job_id]:
            assert needle in message, f"{needle!r} not in: {message}"
    assert not re.search(r'File ".*/distload/', o["output"]), f"a traceback from distload:\n{_describe(o)}"
    assert not (o["ws"] / "out").exists(), "a refused load left a --save-sharded directory"


def test_no_credential_appears_in_any_output_or_report(outcomes):
    from s3_server import ADMIN_KEY, ADMIN_SECRET

    secrets = [ADMIN_KEY, ADMIN_SECRET, *outcomes["secrets"]]
    for job_id, o in outcomes.items():
        if job_id == "secrets":
            continue
        text = o["output"] + json.dumps(o["report"] or {})
        assert not [s for s in secrets if s in text], job_id


def test_503_and_500_are_retried_and_counted(outcomes, base, tmp_path):
    o = outcomes["retried"]
    faulted = [e for e in o["log"] if e.key.startswith("retried/") and e.fault]
    assert sorted(e.status for e in faulted) == [500, 500, 503, 503]
    assert o["report"]["object_store"]["retries"] == 4, o["report"]["object_store"]
    _same_as_directory_load(o, base, tmp_path)


@pytest.mark.parametrize("job_id", ["reset", "short"])
def test_a_body_cut_short_is_asked_for_again_and_no_byte_twice(outcomes, base, tmp_path, job_id):
    o = outcomes[job_id]
    assert o["report"]["object_store"]["retries"] == 1, o["report"]["object_store"]
    got = [e for e in o["log"] if e.key.startswith(f"{job_id}/") and e.key.endswith(".safetensors") and e.status == 206]
    wire, [cut] = sum(e.sent for e in got), [e for e in got if e.fault]
    planned = o["report"]["checkpoint_bytes"] + header_bytes(base)
    if job_id == "short":   # what came before the cut is kept: the request for the rest starts there
        assert wire == planned
    else:   # a reset loses the bytes of the read it broke (urllib3 raises them away): those are asked for again
        assert planned < wire <= planned + cut.sent
    _same_as_directory_load(o, base, tmp_path)


def _cache_folder(outcomes, cache: str, job_id: str, name: str, server) -> Path:
    """The folder the node cache keeps the planned version of `name` (as uploaded from the base) in."""
    import hashlib

    from distload.checkpoint.s3.cache import NodeCache
    from distload.checkpoint.s3.url import ObjectVersion

    data = (outcomes[job_id]["ws"] / "base" / name).read_bytes()
    planned = ObjectVersion(f"{job_id}/{name}", len(data), f'"{hashlib.md5(data).hexdigest()}"')
    return NodeCache(str(outcomes[job_id]["ws"].parent / f"cache-{cache}"), server.url, BUCKET).folder(planned)


def test_refused_loads_cache_only_whole_ranges(outcomes, server):
    for job_id in ("short-always", "overwritten"):
        _cache_is_whole(outcomes[job_id]["ws"].parent / f"cache-{job_id}")
    # the overwritten object's planned version is dropped; the others' ranges fetched before stay, whole
    assert not _cache_folder(outcomes, "overwritten", "overwritten", "model-00002-of-00005.safetensors",
                             server).exists()
    assert _cache_folder(outcomes, "overwritten", "overwritten", "config.json", server).is_dir()


def test_a_second_load_on_the_node_fetches_no_weight_byte(outcomes, base, tmp_path):
    first, again = outcomes["cached"], outcomes["cached-again"]
    assert first["report"]["object_store"]["weights"]["bytes_to_cache"] == first["report"]["checkpoint_bytes"]
    gets = [e for e in again["log"] if e.method == "GET" and e.key.startswith("cached/")]
    assert gets == [], [(e.key, e.range) for e in gets]
    store = again["report"]["object_store"]
    assert store["weights"]["bytes_fetched"] == 0
    assert store["weights"]["bytes_from_cache"] == again["report"]["checkpoint_bytes"]
    _same_as_directory_load(again, base, tmp_path)


def test_an_object_changed_on_the_server_is_fetched_again(outcomes, server, tmp_path):
    o = outcomes["cached-changed"]
    fetched = {e.key for e in o["log"] if e.method == "GET" and e.key.startswith("cached/")}
    assert fetched == {"cached/model-00002-of-00005.safetensors"}, fetched
    changed = o["ws"] / "checkpoint"
    shutil.copytree(o["ws"] / "base", changed)
    shutil.copy(o["ws"] / "changed.safetensors", changed / "model-00002-of-00005.safetensors")
    _same_as_directory_load(o, changed, tmp_path)
    old = _cache_folder(outcomes, "node", "cached", "model-00002-of-00005.safetensors", server)
    assert not old.exists() and len(list(old.parent.iterdir())) == 1   # the old version gone, the new one kept


def test_the_cap_paces_each_reader_at_its_share(outcomes):
    o = outcomes["capped"]
    readers = o["report"]["readers"]
    for r in o["report"]["per_rank"]:
        store = r.get("object_store")
        if r["rank"] in readers:
            assert store["rate_cap_bytes_per_s"] == pytest.approx(0.002e9 / 8 / len(readers))
            assert store["paced_s"] > 0
    assert o["report"]["object_store"]["max_gbps"] == 0.002


def test_inspect_plans_from_the_store(server, outcomes):
    import subprocess
    import sys

    env = {**{k: v for k, v in os.environ.items() if not k.startswith("AWS_")}, **server.env()}
    proc = subprocess.run([sys.executable, "-m", "distload", "inspect", f"s3://{BUCKET}/llama", "--tp", "2"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "route wire" in proc.stdout and "ranged GETs" in proc.stdout, proc.stdout


def test_verify_from_the_store(server, outcomes, base):
    """`distload verify s3://...`: distload's shards from the store, transformers' reference from the directory."""
    env = {**server.env(), "HF_HUB_OFFLINE": "1"}
    url = f"s3://{BUCKET}/llama"
    proc = torchrun_job(NPROC, ["verify", url, "--reference", str(base), "--tp", str(NPROC), "--no-progress"], env)
    assert proc.returncode == 0 and "distload verify" in proc.stdout, proc.stdout[-4000:]
    refused = torchrun_job(NPROC, ["verify", url, "--tp", str(NPROC), "--no-progress"], env)
    lines = dict(ERROR_LINE.findall(refused.stdout))
    # refused before any process group: torchrun may stop one rank before it prints (tests/jobs/test_faults.py)
    assert refused.returncode != 0 and lines, refused.stdout[-4000:]
    assert all("--reference DIR" in m and url in m for m in lines.values()), lines


def _python(code: str, env: dict):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**{k: v for k, v in os.environ.items() if not k.startswith("AWS_")}, **env})


def test_without_the_client_an_s3_path_names_the_extra(server):
    proc = _python("import sys; sys.modules['boto3'] = None\nfrom distload.cli import main\n"
                   f"sys.exit(main(['inspect', 's3://{BUCKET}/llama', '--tp', '2']))", server.env())
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == ("distload: error on rank 0: s3:// checkpoints need distload's s3 "
                                                    "extra (boto3, not installed here: boto3): pip install "
                                                    "'distload[s3]'"), proc.stderr


def test_a_local_load_never_imports_the_client(base):
    proc = _python(f"import sys, distload\ndistload.inspect({str(base)!r}, tp=2)\n"
                   "print(sorted(m for m in sys.modules if m.split('.')[0] in ('boto3', 'botocore')))", {})
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_an_overwrite_mid_load_names_both_etags(outcomes):
    import hashlib

    o = outcomes["overwritten"]
    name = "model-00002-of-00005.safetensors"
    planned, now = (f'"{hashlib.md5(p.read_bytes()).hexdigest()}"' for p in (o["ws"] / "base" / name,
                                                                              o["ws"] / "changed.safetensors"))
    for [message] in _lines(o).values():
        assert f"ETag {planned} when the load was planned, {now} now" in message, message
