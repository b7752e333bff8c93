"""`distload verify` on a family its reference forward does not know (Falcon, issue 38): refused before any load,
one line on every rank naming the family and what to use instead (the vLLM comparison)."""

from __future__ import annotations

import pytest

from distload.errors import DistloadError
from distload.options import LoadOptions
from distload.verify import refuse_without_reference
from hf_models import save_checkpoint
from jobs import torchrun_verify


@pytest.fixture(scope="module")
def falcon(tmp_path_factory):
    return save_checkpoint("falcon", tmp_path_factory.mktemp("falcon") / "falcon")


def test_a_family_without_a_reference_forward_is_refused_naming_it(falcon, tmp_path):
    with pytest.raises(DistloadError, match=r"verify: family falcon \(model_type 'falcon'\) has no reference forward "
                                            r".*rules check auto CKPT --tp 2 --against vllm"):
        refuse_without_reference(str(falcon), LoadOptions())
    refuse_without_reference(str(save_checkpoint("llama", tmp_path / "llama")), LoadOptions())   # known: no error


def test_torchrun_verify_refuses_it_on_every_rank_before_any_load(falcon):
    proc = torchrun_verify(2, str(falcon), "--tp", "2")
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("distload: error on rank")]
    assert sorted(line[:26] for line in lines) == ["distload: error on rank 0:", "distload: error on rank 1:"], \
        proc.stderr[-3000:]
    assert all("family falcon (model_type 'falcon') has no reference forward" in line for line in lines)
    assert not proc.stdout.strip(), proc.stdout   # no load summary, no forward: nothing ran before the refusal
