"""Tests by kind, one folder each (the fast run is a folder, not a list):

    pure/          no other process, no model saved by transformers: planning, rules, parsers, kernels' references
                   (`scripts/test.sh --fast` runs this folder alone)
    checkpoints/   in this process, on tiny checkpoints saved by transformers: plans of real models, the oracles
    ranks/         real gloo process groups in processes of their own (support/spawn.py)
    jobs/          whole jobs: torchrun and the CLI, the hostile corpus, benchmarks' smoke runs, vLLM
    support/       helpers the tests import as plain modules (on sys.path); no tests, and no test module imports
                   another test module (tests/pure/test_structure.py checks both)
"""

import multiprocessing.process
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE / "support"))  # tests import spawn, hf_models, layout_oracle, ... as plain modules
PURE = HERE / "pure"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if PURE in item.path.parents:
            item.add_marker(pytest.mark.pure)


@pytest.fixture(autouse=True)
def pure_tests_start_no_process(request, monkeypatch):
    """A pure test that starts a process fails and says so, so the fast run stays fast as tests are added."""
    if request.node.get_closest_marker("pure") is None:
        return

    def refuse(*args, **kwargs):
        raise AssertionError(f"{request.node.nodeid} starts a process, but it is in tests/pure/: move it to the "
                             f"folder of its kind (tests/conftest.py)")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)


@pytest.fixture(scope="session")
def dense_checkpoints(tmp_path_factory):
    """One tiny random checkpoint per dense family (several safetensors files + index each)."""
    from hf_models import DENSE, save_checkpoint

    root = tmp_path_factory.mktemp("dense")
    return {fam: str(save_checkpoint(fam, root / fam)) for fam in DENSE}
