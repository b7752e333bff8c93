"""Cases: a sharded save (cases_runtime's save-ok: the demo at tp 2) whose manifest was edited, or whose files
no longer match it, and reshards into layouts that cannot be."""

from __future__ import annotations

import json

from distload.sharded.manifest import DIGEST, MANIFEST, manifest_digest

from .case import Case
from .cases_runtime import SAVED, saved_copy

RANK0, RANK1 = "rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"


def _edited(edit, digest=True):
    """The save with its manifest changed by edit(dict) in place; its own sha256 made again (digest=True: an
    edit by a tool that knows the format, so the fields themselves must be checked) or left as saved."""
    def build(ckpt, ws):
        saved = saved_copy(ws)
        manifest = json.loads((saved / MANIFEST).read_text())
        edit(manifest)
        if digest:
            manifest[DIGEST] = manifest_digest(manifest)
        (saved / MANIFEST).write_text(json.dumps(manifest))
        return [str(saved)]
    return build


def _files(change, *options):
    """The save with its files changed by change(saved dir), loaded by `options`."""
    def build(ckpt, ws):
        saved = saved_copy(ws)
        change(saved)
        return [str(saved), *options]
    return build


def _swap(saved):
    (saved / RANK0).rename(saved / "tmp")
    (saved / RANK1).rename(saved / RANK0)
    (saved / "tmp").rename(saved / RANK1)


def _truncate(saved):
    path = saved / RANK1
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _other_model(saved):
    """rank 1's file from a save of another model with the same tensor names (values scaled: same header)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(saved / RANK1)
    save_file({n: t * 2 for n, t in tensors.items()}, str(saved / RANK1), metadata={"format": "pt"})


def _reshard_to(*options):
    return _files(lambda saved: None, "--reshard", "--save-sharded", "{out}", *options)


def _out(build):
    """`{out}` in the arguments is the case's out/ (the runner checks nothing complete-looking was written)."""
    def wrapped(ckpt, ws):
        return [a.replace("{out}", str(ws / "out")) for a in build(ckpt, ws)]
    return wrapped


def _set(**fields):
    return lambda m: m.update(fields)


def _stages(m):
    m.update(pp=2, pp_layers=[1, 1], rank_stages=[{"pp_rank": 0, "layers": [0, 1]}, {"pp_rank": 1, "layers": [1, 2]}])


CASES = [
    Case("save-claims-pp-2", _edited(_set(pp=2)), after=SAVED, names=(MANIFEST, "tp", "pp 2")),
    Case("save-claims-pp-2-with-stages", _edited(_stages), after=SAVED, names=(MANIFEST, "tp")),
    Case("save-claims-tp-1", _edited(_set(tp=1)), after=SAVED, names=(MANIFEST, "replica", "tp x pp = 1")),
    Case("save-claims-tp-4", _edited(_set(tp=4)), after=SAVED, names=(MANIFEST, "tp")),
    Case("save-claims-world-4", _edited(_set(world_size=4)), after=SAVED, names=(MANIFEST, "files", "of-00004")),
    Case("save-claims-ep-2", _edited(_set(ep=2)), after=SAVED, names=("ep 2", "--reshard")),
    Case("save-edited-no-new-digest", _edited(_set(expert_placement="round_robin"), digest=False), after=SAVED,
         names=(MANIFEST, DIGEST)),
    Case("save-digest-broken", _edited(_set(**{DIGEST: "0" * 64}), digest=False), after=SAVED,
         names=(MANIFEST, DIGEST)),
    Case("save-digest-missing", _edited(lambda m: m.pop(DIGEST), digest=False), after=SAVED,
         names=(MANIFEST, DIGEST)),
    Case("save-rank-files-swapped", _files(_swap), after=SAVED, names=("swapped",)),
    Case("save-rank-files-swapped-no-checksums", _files(_swap, "--no-checksums"), after=SAVED, names=("swapped",)),
    Case("save-rank-file-of-other-model", _files(_other_model), after=SAVED, names=(RANK1,)),
    Case("save-rank-file-truncated", _files(_truncate), after=SAVED, names=(RANK1,)),
    Case("save-manifest-missing", _files(lambda s: (s / MANIFEST).unlink()), after=SAVED, names=(MANIFEST,)),
    Case("save-reshard-tp-3", _out(_reshard_to("--tp", "3")), nproc=3, after=SAVED,
         names=("tp=3", "num_attention_heads=8")),
    Case("save-reshard-pp-layers-3-0", _out(_reshard_to("--tp", "1", "--pp", "2", "--pp-layers", "3,0")),
         after=SAVED, names=("--pp-layers",)),
]

EXTRA: list[Case] = []
