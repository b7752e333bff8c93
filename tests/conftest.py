import multiprocessing.process
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests import spawn, hf_models, layout_oracle as plain modules

# The test modules whose tests are pure: no other process, no model saved by transformers, only small files.
# They get the `pure` marker, which `scripts/test.sh --fast` (pytest -m pure) selects; a test in them that must
# start a process is marked @pytest.mark.spawns and left to the whole suite. A module joins by being named here.
PURE_MODULES = (
    "test_checkpoint",
    "test_host_memory",
    "test_kernels",
    "test_kernels_4bit",
    "test_names",
    "test_rules",
    "test_shard",
    "test_stages",
    "test_structure",
    "test_validate",
)


def pytest_ignore_collect(collection_path, config):
    """Under `-m pure` the other test modules are not even imported (they import transformers, spawn helpers)."""
    name = collection_path.stem
    if config.getoption("markexpr") == "pure" and name.startswith("test_") and name not in PURE_MODULES:
        return True
    return None  # pytest's own rules decide


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.stem in PURE_MODULES and item.get_closest_marker("spawns") is None:
            item.add_marker(pytest.mark.pure)


@pytest.fixture(autouse=True)
def pure_tests_start_no_process(request, monkeypatch):
    """A pure test that starts a process fails and says so, so the fast run stays fast as tests are added."""
    if request.node.get_closest_marker("pure") is None:
        return

    def refuse(*args, **kwargs):
        raise AssertionError(
            f"{request.node.nodeid} starts a process, but its module is in PURE_MODULES (tests/conftest.py): "
            "mark the test @pytest.mark.spawns or move it to a module that is not"
        )

    monkeypatch.setattr(subprocess, "Popen", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)


@pytest.fixture(scope="session")
def dense_checkpoints(tmp_path_factory):
    """One tiny random checkpoint per dense family (several safetensors files + index each)."""
    from hf_models import DENSE, save_checkpoint

    root = tmp_path_factory.mktemp("dense")
    return {fam: str(save_checkpoint(fam, root / fam)) for fam in DENSE}
