"""distload/sharded/manifest.py: every field of a sharded save's manifest typed and checked, the error naming
the field (a damaged manifest is refused before a rank file is opened, never a traceback deep in the reload)."""

from __future__ import annotations

import copy
import json

import pytest

from distload.errors import CheckpointError
from distload.sharded.manifest import (DIGEST, FORMAT, FORMAT_VERSION, MANIFEST, check_manifest, manifest_digest,
                                       read_manifest)

SHA = "0" * 64


def valid() -> dict:
    ranks = [{"local_shape": [4, 8], "offset": 128, "sha256": SHA}, {"local_shape": [4, 8], "offset": 128, "sha256": SHA}]
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "world_size": 2, "tp": 2, "ep": 1,
            "expert_placement": "linear", "config_name": "llama", "source_checkpoint": "/ckpt",
            "hf_config": {"architectures": ["LlamaForCausalLM"]},
            "checkpoint_tensors": {"lm_head.weight": {"dtype": "BF16", "shape": [8, 8]}},
            "files": ["rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"],
            "params": {"lm_head.weight": {"style": "vocab", "dtype": "BF16", "global_shape": [8, 8], "ranks": ranks},
                       "model.embed_tokens.weight": {"style": "vocab", "dtype": "BF16", "global_shape": [8, 8],
                                                     "alias_of": "lm_head.weight"}}}


HEAD = "params[\"lm_head.weight\"]"
DAMAGE = [
    ("world_size", lambda m: m.update(world_size="2"), "world_size"),
    ("world_size-zero", lambda m: m.update(world_size=0), "world_size"),
    ("tp-string", lambda m: m.update(tp="two"), "tp"),
    ("tp-not-divisor", lambda m: m.update(tp=3), "tp: expected a divisor of world_size 2"),
    ("ep-zero", lambda m: m.update(ep=0), "ep"),
    ("no-params", lambda m: m.pop("params"), "params: expected an object: param name -> its record, missing"),
    ("params-list", lambda m: m.update(params=list(m["params"])), "params"),
    ("no-hf-config", lambda m: m.pop("hf_config"), "hf_config"),
    ("hf-config-string", lambda m: m.update(hf_config="llama"), "hf_config"),
    ("config-name-int", lambda m: m.update(config_name=3), "config_name"),
    ("placement", lambda m: m.update(expert_placement="diagonal"), "expert_placement"),
    ("files", lambda m: m.update(files=m["files"][:1]), "files"),
    ("huge-world", lambda m: m.update(world_size=10 ** 12), "files"),
    ("tensors-shape", lambda m: m["checkpoint_tensors"]["lm_head.weight"].update(shape="8"),
     'checkpoint_tensors["lm_head.weight"].shape'),
    ("style", lambda m: m["params"]["lm_head.weight"].update(style="diagonal"), HEAD + ".style"),
    ("dtype", lambda m: m["params"]["lm_head.weight"].update(dtype="F99"), HEAD + ".dtype"),
    ("global-shape", lambda m: m["params"]["lm_head.weight"].update(global_shape="256"), HEAD + ".global_shape"),
    ("ranks-short", lambda m: m["params"]["lm_head.weight"]["ranks"].pop(), HEAD + ".ranks"),
    ("record-null", lambda m: m["params"]["lm_head.weight"]["ranks"].__setitem__(1, None), HEAD + ".ranks[1]"),
    ("no-offset", lambda m: m["params"]["lm_head.weight"]["ranks"][0].pop("offset"), HEAD + ".ranks[0].offset"),
    ("offset-negative", lambda m: m["params"]["lm_head.weight"]["ranks"][0].update(offset=-1), ".ranks[0].offset"),
    ("local-shape-rank", lambda m: m["params"]["lm_head.weight"]["ranks"][1].update(local_shape=[32]),
     HEAD + ".ranks[1].local_shape"),
    ("sha256", lambda m: m["params"]["lm_head.weight"]["ranks"][1].update(sha256=5), ".ranks[1].sha256"),
    ("alias-dangling", lambda m: m["params"]["model.embed_tokens.weight"].update(alias_of="nothing"), "alias_of"),
    ("entry-list", lambda m: m["params"].update({"x": [1]}), 'params["x"]'),
    ("tp-claimed-1", lambda m: (m.update(tp=1), m["params"]["lm_head.weight"]["ranks"][1].update(sha256="1" * 64)),
     HEAD + ".ranks[1]: expected the shard of rank 0, its data-parallel replica at tp x pp = 1"),
]


@pytest.mark.parametrize("case,edit,needle", DAMAGE, ids=[d[0] for d in DAMAGE])
def test_damaged_field_is_named(tmp_path, case, edit, needle):
    manifest = copy.deepcopy(valid())
    edit(manifest)
    if isinstance(manifest, dict):   # the damage is what is named, not the checksum it breaks
        manifest[DIGEST] = manifest_digest(manifest)
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError) as info:
        read_manifest(tmp_path)
    assert needle in str(info.value) and "save again" in str(info.value), str(info.value)


def test_valid_manifest_passes(tmp_path):
    check_manifest(valid(), tmp_path / MANIFEST)


def test_an_edited_manifest_is_refused_by_its_own_checksum(tmp_path):
    """Every field valid, but not what the save wrote: a tp-2 save claimed as pp 2 x tp 1, or a shape changed."""
    manifest = valid()
    (tmp_path / MANIFEST).write_text(json.dumps({**manifest, DIGEST: manifest_digest(manifest)}))
    assert read_manifest(tmp_path)["tp"] == 2
    edited = copy.deepcopy(manifest)
    edited["params"]["lm_head.weight"]["ranks"][1]["local_shape"] = [8, 4]
    (tmp_path / MANIFEST).write_text(json.dumps({**edited, DIGEST: manifest_digest(manifest)}))
    with pytest.raises(CheckpointError, match=r"manifest_sha256: .*edited or damaged since the save.*save again"):
        read_manifest(tmp_path)
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))   # no checksum at all
    with pytest.raises(CheckpointError, match=r"manifest_sha256: .*has none"):
        read_manifest(tmp_path)


def test_a_manifest_claiming_stages_without_their_records_is_damaged(tmp_path):
    manifest = valid()
    manifest.update(tp=1, pp=2)   # what a tp-2 save edited to claim two pipeline stages looks like
    with pytest.raises(CheckpointError, match=r"pp_layers: expected 2 layer counts .*missing"):
        check_manifest(manifest, tmp_path / MANIFEST)
    manifest.update(pp_layers=[1, 1], rank_stages=[{"pp_rank": 0, "layers": [0, 1]}, {"pp_rank": 0, "layers": [0, 1]}])
    with pytest.raises(CheckpointError, match=r"rank_stages\[1\]: expected \{'pp_rank': 1, 'layers': \[1, 2\]\}"):
        check_manifest(manifest, tmp_path / MANIFEST)
    manifest["rank_stages"][1] = {"pp_rank": 1, "layers": [1, 2]}
    with pytest.raises(CheckpointError, match=r'params\["lm_head.weight"\].pp_ranks: .*missing'):
        check_manifest(manifest, tmp_path / MANIFEST)
