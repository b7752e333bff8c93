import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests import spawn, hf_models, layout_oracle as plain modules


@pytest.fixture(scope="session")
def dense_checkpoints(tmp_path_factory):
    """One tiny random checkpoint per dense family (several safetensors files + index each)."""
    from hf_models import DENSE, save_checkpoint

    root = tmp_path_factory.mktemp("dense")
    return {fam: str(save_checkpoint(fam, root / fam)) for fam in DENSE}
