"""distload/validate.py: every option and output path a user can get wrong is refused, naming the option."""

from __future__ import annotations

import json
import math

import pytest

from distload.errors import DistloadError
from distload.validate import (OptionError, check_backend, check_device, check_hf_config, check_positive,
                               check_readers, check_report_path, check_save_path, check_timeout, read_expert_map,
                               validate_load_options)


def refused(fn, *args, names=(), **kwargs) -> str:
    with pytest.raises(OptionError) as info:
        fn(*args, **kwargs)
    for needle in names:
        assert needle in str(info.value), f"{needle!r} not in {info.value}"
    assert isinstance(info.value, DistloadError)
    return str(info.value)


@pytest.mark.parametrize("value", [0, -1, math.nan, math.inf, "600", True, None])
def test_timeout_must_be_positive_seconds(value):
    refused(check_timeout, value, names=("--timeout", "above 0"))


def test_timeout_ok():
    assert check_timeout(0.5) == 0.5 and check_timeout(600) == 600.0


@pytest.mark.parametrize("option,value", [("--tp", 0), ("--tp", -2), ("--ep", 0), ("--staging-mib", 0),
                                          ("--staging-mib", -4), ("--staging-mib", 1.5), ("--tp", True)])
def test_counts_must_be_at_least_one(option, value):
    refused(check_positive, option, value, "2", names=(option, "at least 1"))


def test_counts_ok():
    check_positive("--tp", None, "2")
    check_positive("--staging-mib", 1, "16")


@pytest.mark.parametrize("value", [0, -1, "two"])
def test_readers(value):
    refused(check_readers, value, names=("--readers",))


def test_readers_ok():
    for value in ("per-node", "owners", 1, 3):
        check_readers(value)


@pytest.mark.parametrize("device,needle", [("nonsense", "not a device name"), ("meta", "cpu or cuda"),
                                           ("cuda:99", "cuda")])
def test_device(device, needle):
    refused(check_device, device, names=("--device", device, needle))


def test_device_ok():
    check_device(None)
    check_device("cpu")


def test_backend():
    refused(check_backend, "carrier-pigeon", names=("--backend", "gloo"))
    check_backend(None)
    check_backend("gloo")


def write(tmp_path, content, name="eplb.json"):
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


@pytest.mark.parametrize("content,needle", [
    ("[[0, 1], [2,", "not valid JSON"),
    ({"experts": [[0, 1]]}, "'ranks'"),
    ([0, 1, 2], "a list per rank"),
    ([], "a list per rank"),
    ([["a"], ["b"]], "not an expert id"),
    ([[0, -1], [2]], "not an expert id"),
    ([[0, 1], [1, 2]], "expert 1 is on rank 0 and rank 1"),
])
def test_expert_map_shape(tmp_path, content, needle):
    refused(read_expert_map, write(tmp_path, content), names=("--expert-map", "eplb.json", needle))


def test_expert_map_missing_and_world(tmp_path):
    refused(read_expert_map, str(tmp_path / "none.json"), names=("--expert-map", "none.json", "cannot read"))
    refused(read_expert_map, write(tmp_path, [[0], [1], [2]]), 2, names=("3 ranks", "has 2"))
    assert read_expert_map(write(tmp_path, {"ranks": [[3, 0], [1, 2]]}), 2) == [[3, 0], [1, 2]]


def test_report_path(tmp_path):
    refused(check_report_path, str(tmp_path / "no" / "dir" / "r.json"), names=("--report", "does not exist"))
    refused(check_report_path, str(tmp_path), names=("--report", "is a directory"))
    refused(check_report_path, "/proc/distload-r.json", names=("--report", "cannot write"))
    check_report_path(str(tmp_path / "r.json"))
    check_report_path(None)
    assert list(tmp_path.iterdir()) == []  # the probe leaves nothing behind


def test_save_path(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    refused(check_save_path, str(ckpt), str(ckpt), names=("--save-sharded", "inside the checkpoint"))
    refused(check_save_path, str(ckpt / "sub" / "out"), str(ckpt), names=("inside the checkpoint",))
    (tmp_path / "file").write_text("x")
    refused(check_save_path, str(tmp_path / "file"), str(ckpt), names=("--save-sharded", "not a directory"))
    refused(check_save_path, str(tmp_path / "file" / "out"), str(ckpt), names=("not a directory",))
    refused(check_save_path, "/proc/distload-out", str(ckpt), names=("--save-sharded", "cannot write"))
    check_save_path(str(tmp_path / "new" / "deeper"), str(ckpt))   # parents are made by the save
    check_save_path(str(tmp_path), str(ckpt))                      # an existing directory (a previous save)


def test_save_path_through_a_symlink_into_the_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (tmp_path / "link").symlink_to(ckpt)
    refused(check_save_path, str(tmp_path / "link" / "out"), str(ckpt), names=("inside the checkpoint",))


def test_hf_config(tmp_path):
    refused(check_hf_config, "/nonexistent", names=("--hf-config", "/nonexistent", "does not exist"))
    refused(check_hf_config, str(tmp_path), names=("--hf-config", "no config.json"))
    (tmp_path / "config.json").write_text("[1]")
    refused(check_hf_config, str(tmp_path), names=("not a JSON object",))
    (tmp_path / "config.json").write_text("{")
    refused(check_hf_config, str(tmp_path), names=("cannot read config.json",))
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    check_hf_config(str(tmp_path))


def test_validate_load_options_runs_every_check(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    assert validate_load_options(str(ckpt)) is None
    assert validate_load_options(str(ckpt), expert_map_file=write(tmp_path, [[0, 1], [2, 3]]), world=2) == \
        [[0, 1], [2, 3]]
    refused(validate_load_options, str(ckpt), timeout_s=0, names=("--timeout",))
    refused(validate_load_options, str(ckpt), staging_mib=0, names=("--staging-mib",))
    refused(validate_load_options, str(ckpt), save_sharded=str(ckpt), names=("--save-sharded",))
    refused(validate_load_options, str(ckpt), report=str(tmp_path / "x" / "r.json"), names=("--report",))
