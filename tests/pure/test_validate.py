"""distload/validate.py: every option and output path a user can get wrong is refused, naming the option."""

from __future__ import annotations

import json
import math

import pytest

from distload.errors import DistloadError
from distload.options import LoadOptions
from distload.validate import (OptionError, check_backend, check_device, check_expert_map, check_hf_config,
                               check_positive, check_readers, check_report_path, check_save_path,
                               check_staging_mib, check_timeout, read_expert_map, validate_load_options)


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
    ([[0, 1], None], "rank 1: None where that rank's list of expert ids should be"),
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
    (tmp_path / "previous").mkdir()
    (tmp_path / "previous" / "manifest.json").write_text("{}")
    check_save_path(str(tmp_path / "previous"), str(ckpt))           # a previous save (the save replaces it)
    (tmp_path / "empty").mkdir()
    check_save_path(str(tmp_path / "empty"), str(ckpt))


def test_save_path_refuses_a_foreign_directory_before_loading(tmp_path):
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "notes.txt").write_text("mine")
    refused(check_save_path, str(tmp_path / "precious"), str(tmp_path / "ckpt"),
            names=("--save-sharded", "not a distload save", "manifest.json"))


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
    assert validate_load_options(str(ckpt), LoadOptions()) is None
    options = LoadOptions(expert_map=read_expert_map(write(tmp_path, [[0, 1], [2, 3]]), 2))
    assert options.expert_map == ((0, 1), (2, 3))
    refused(LoadOptions, timeout_s=0, names=("--timeout",))
    refused(LoadOptions, staging_mib=0, names=("--staging-mib",))
    refused(validate_load_options, str(ckpt), LoadOptions(save_sharded=str(ckpt)), names=("--save-sharded",))
    refused(LoadOptions, report=str(tmp_path / "x" / "r.json"), names=("--report",))


@pytest.mark.parametrize("option,value", [
    ("tp", 0), ("tp", -2), ("ep", 0), ("readers", 0), ("device", "nonsense"), ("backend", "carrier-pigeon"),
    ("timeout_s", math.nan), ("staging_mib", -4), ("expert_map", [["a"], ["b"]]), ("hf_config", "/nonexistent"),
    ("save_sharded", "/proc/distload-out"), ("report", "/proc/r.json"),
])
def test_load_options_refuse_what_the_command_line_refuses(option, value):
    """The Python API gets the command line's checks: LoadOptions checks itself when made (and replaced)."""
    flag = {"timeout_s": "--timeout"}.get(option, "--" + option.replace("_", "-"))
    refused(LoadOptions, **{option: value}, names=(flag,))
    refused(LoadOptions().replace, **{option: value}, names=(flag,))


@pytest.mark.parametrize("value", [0, -4, math.nan, "16", True])
def test_staging_mib_must_be_positive_mib(value):
    refused(check_staging_mib, value, names=("--staging-mib", "above 0"))


def test_staging_mib_ok():
    for value in (None, 1, 16, 0.01):   # a fraction of a MiB makes small buckets (tests)
        check_staging_mib(value)


def test_expert_map_values():
    check_expert_map(((0, 1), (2, 3)))
    refused(check_expert_map, [[0, True]], names=("--expert-map", "not an expert id"))
    # An expert on several ranks is legal (an expert group's ranks share it; EPLB replicas): planning checks it.
    check_expert_map([[0, 1], [0, 1], [1, 2], [1, 2]])


def test_the_python_api_refuses_a_save_inside_the_checkpoint_before_any_rendezvous(tmp_path):
    """distload.load checks what only the checkpoint's path tells (as the command line does), before it
    looks for peers: no process group exists here, and the refusal names the option."""
    import distload

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    with pytest.raises(OptionError, match="--save-sharded .* is inside the checkpoint"):
        distload.load(str(ckpt), save_sharded=str(ckpt / "saved"), progress=False)


def test_save_for_names_a_known_server_and_needs_a_save(tmp_path):
    from distload.validate import check_save_for

    check_save_for(None, None)
    check_save_for("vllm", str(tmp_path / "out"))
    check_save_for("vllm==0.32.0", str(tmp_path / "out"))
    refused(check_save_for, "sglang", str(tmp_path / "out"), names=("--for 'sglang'", "vllm"))
    refused(check_save_for, "vllm==", str(tmp_path / "out"), names=("--for 'vllm=='",))
    refused(check_save_for, "vllm", None, names=("--for vllm", "add --save-sharded OUT"))


def test_every_engine_a_save_can_be_for_has_a_save_format():
    """--for accepts the engines with a naming file (configs/serving/); each must have its save format's row."""
    from distload.serving.export import SAVES
    from distload.validate import serving_engines

    assert serving_engines() and set(serving_engines()) == set(SAVES)
