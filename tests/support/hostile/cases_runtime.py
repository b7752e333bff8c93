"""Cases: valid loads (the corpus must not refuse them), damaged sharded saves, ranks lost early."""

from __future__ import annotations

import hashlib
import json
import shutil

from .case import Case

MANIFEST = "manifest.json"
SAVED = "save-ok"  # the case whose sharded save the tampering cases copy


def _with_checksums(*extra):
    def build(ckpt, ws):
        lines = [f"{hashlib.sha256(f.read_bytes()).hexdigest()}  {f.name}" for f in sorted(ckpt.glob("*.safetensors"))]
        (ckpt / "checksums").write_text("\n".join(lines) + "\n")
        return [str(ckpt), "--verify-checksums", *extra]
    return build


def saved_copy(ws):
    dst = ws / "saved"
    shutil.copytree(ws.parent / SAVED / "saved", dst)
    return dst


def _manifest(edit):
    """A copy of the save with manifest.json changed by edit(manifest dict) -> dict or str."""
    def build(ckpt, ws):
        saved = saved_copy(ws)
        value = edit(json.loads((saved / MANIFEST).read_text()))
        (saved / MANIFEST).write_text(value if isinstance(value, str) else json.dumps(value))
        return [str(saved)]
    return build


def _without(key):
    return lambda m: {k: v for k, v in m.items() if k != key}


def _first_param(edit):
    def fn(m):
        name = next(n for n, e in sorted(m["params"].items()) if "ranks" in e)
        edit(m["params"][name])
        return m
    return fn


def _reload(*extra, remove=None):
    def build(ckpt, ws):
        saved = saved_copy(ws)
        if remove:
            (saved / remove).unlink()
        return [str(saved), *extra]
    return build


def _plain(*extra):
    return lambda ckpt, ws: [str(ckpt), *extra]


def _mixtral_map(ckpt, ws):
    (ws / "eplb.json").write_text(json.dumps({"ranks": [[3, 0], [1, 2]]}))
    return [str(ckpt), "--tp", "1", "--ep", "2", "--expert-map", str(ws / "eplb.json")]


_KILL_PLANNING = (("DISTLOAD_FAULT", "kill@rank1:planning"),)

VALID = [
    Case("ok-demo", _plain(), expect="ok"),
    Case("ok-verify-checksums", _with_checksums(), expect="ok"),
    Case(SAVED, lambda ckpt, ws: [str(ckpt), "--save-sharded", str(ws / "saved"), "--report", str(ws / "r.json")],
         expect="ok"),
    Case("ok-mixtral-expert-map", _mixtral_map, base="mixtral", expect="ok"),
]

SHARDED = [
    Case("sharded-reload-ok", _reload(), expect="ok", after=SAVED),
    Case("sharded-world-mismatch", _reload(), nproc=4, after=SAVED, names=("--reshard",)),
    Case("sharded-rank-file-missing", _reload(remove="rank-00001-of-00002.safetensors"), after=SAVED,
         names=("rank-00001-of-00002.safetensors",)),
    Case("manifest-not-json", _manifest(lambda m: '{"format": '), after=SAVED, names=(MANIFEST,)),
    Case("manifest-world-size-string", _manifest(lambda m: {**m, "world_size": "2"}), after=SAVED,
         names=("world_size",)),
    Case("manifest-params-list", _manifest(lambda m: {**m, "params": list(m["params"])}), after=SAVED,
         names=("params",)),
    Case("manifest-global-shape-string", _manifest(_first_param(lambda e: e.update(global_shape="256"))),
         after=SAVED, names=("global_shape",)),
    Case("manifest-rank-record-no-offset", _manifest(_first_param(lambda e: e["ranks"][0].pop("offset", None))),
         after=SAVED, names=("offset",)),
    Case("manifest-style-unknown", _manifest(_first_param(lambda e: e.update(style="diagonal"))), after=SAVED,
         names=("style",)),
]

def _save_to(name):
    return lambda ckpt, ws: [str(ckpt), "--save-sharded", str(ws / name)]


RANKS = [
    Case("save-fails-mid-write-on-rank-1", _save_to("saved"), small_files_rank=1,
         names=("--save-sharded", "rank-00001-of-00002.safetensors")),
    Case("rank-lost-before-rendezvous", _plain("--timeout", "5"), lost_rank=1, never_starts=True,
         names=("rank 1", "did not arrive", "5 s")),  # its own --timeout: the wait is the case's cost
    Case("rank-killed-while-planning", _plain(), env=_KILL_PLANNING, lost_rank=1, names=("rank 1",)),
]

CASES = VALID + SHARDED + RANKS

# Further cases of the same kinds: `python -m tests.support.hostile --all` runs them too (kept out of the suite's time).
EXTRA = [
    Case("manifest-no-hf-config", _manifest(_without("hf_config")), after=SAVED, names=("hf_config",)),
    Case("ok-verify-checksums-2-readers", _with_checksums("--readers", "2"), expect="ok", nproc=4),
    Case("sharded-reload-verify", _reload("--verify-checksums"), expect="ok", after=SAVED),
    Case("manifest-no-params", _manifest(_without("params")), after=SAVED, names=("params",)),
    Case("manifest-dtype-unknown", _manifest(_first_param(lambda e: e.update(dtype="F99"))), after=SAVED,
         names=("dtype",)),
    Case("ok-demo-4-ranks", _plain(), expect="ok", nproc=4),
    Case("ok-staging-1-mib", _plain("--staging-mib", "1"), expect="ok"),
    Case("manifest-array", _manifest(lambda m: [m]), after=SAVED, names=(MANIFEST,)),
    Case("manifest-tp-string", _manifest(lambda m: {**m, "tp": "two"}), after=SAVED, names=("tp",)),
    Case("manifest-ep-zero", _manifest(lambda m: {**m, "ep": 0}), after=SAVED, names=("ep",)),
    Case("manifest-hf-config-string", _manifest(lambda m: {**m, "hf_config": "llama"}), after=SAVED,
         names=("hf_config",)),
    Case("manifest-rank-record-null", _manifest(_first_param(lambda e: e["ranks"].__setitem__(1, None))),
         after=SAVED),
]
