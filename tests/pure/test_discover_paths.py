"""distload/checkpoint/discover.py: an index naming one file two ways ('./f' and 'f') names one file."""

from __future__ import annotations

import json

import pytest

from distload.checkpoint.discover import SAFETENSORS_INDEX, discover, normalized
from distload.demo import make_demo_checkpoint
from distload.errors import CheckpointError


def test_normalized():
    assert normalized("./model.safetensors") == "model.safetensors"
    assert normalized("sub//./a.safetensors") == "sub/a.safetensors"
    assert normalized("../a.safetensors") == "../a.safetensors"      # refused later, by the name as written
    assert normalized("/abs.safetensors") == "/abs.safetensors"


def test_dot_slash_and_plain_are_one_file(tmp_path):
    ckpt = make_demo_checkpoint(tmp_path / "ckpt")
    index = json.loads((ckpt / SAFETENSORS_INDEX).read_text())
    plain = discover(ckpt)
    for n in sorted(index["weight_map"])[::2]:
        index["weight_map"][n] = "./" + index["weight_map"][n]
    (ckpt / SAFETENSORS_INDEX).write_text(json.dumps(index))
    found = discover(ckpt)
    assert found.files == plain.files and found.tensors == plain.tensors


def test_dot_dot_still_refused(tmp_path):
    ckpt = make_demo_checkpoint(tmp_path / "ckpt")
    index = json.loads((ckpt / SAFETENSORS_INDEX).read_text())
    name = sorted(index["weight_map"])[0]
    index["weight_map"][name] = "sub/../" + index["weight_map"][name]
    (ckpt / SAFETENSORS_INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"'\.\.'"):
        discover(ckpt)
