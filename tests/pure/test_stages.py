"""distload/stages.py: vLLM's layer split for pipeline stages, and the refusals with the numbers."""

from __future__ import annotations

import pytest

from distload.errors import PlanError
from distload.stages import parse_partition, pp_layer_range, pp_partition


@pytest.mark.parametrize("layers,pp,ranges", [
    (3, 2, [(0, 2), (2, 3)]),
    (5, 3, [(0, 2), (2, 4), (4, 5)]),
    (4, 4, [(0, 1), (1, 2), (2, 3), (3, 4)]),
    (8, 1, [(0, 8)]),
    (7, 4, [(0, 2), (2, 4), (4, 6), (6, 7)]),
])
def test_default_split_is_vllms(layers, pp, ranges):
    assert [(r.start, r.stop) for r in (pp_layer_range(layers, i, pp) for i in range(pp))] == ranges


def test_deepseek_v3_61_layers_on_4_stages():
    assert pp_partition(61, 4) == (15, 15, 16, 15)


def test_explicit_partition_is_taken_as_given():
    assert pp_partition(6, 2, (1, 5)) == (1, 5)
    assert pp_layer_range(6, 1, 2, (1, 5)) == range(1, 6)
    assert parse_partition("1, 5") == (1, 5) and parse_partition(None) is None and parse_partition("") is None


@pytest.mark.parametrize("layers,pp,partition,words", [
    (2, 3, None, ["--pp 3", "2 layers", "--pp 2"]),
    (6, 2, (3, 2), ["sums to 5", "has 6"]),
    (6, 2, (6, 0), ["at least one layer"]),
    (6, 3, (3, 3), ["2 stages given for --pp 3"]),
])
def test_bad_stage_splits_are_refused_with_the_numbers(layers, pp, partition, words):
    with pytest.raises(PlanError) as exc:
        pp_partition(layers, pp, partition)
    for word in words:
        assert word in str(exc.value)


def test_unparsable_partition_is_named():
    with pytest.raises(PlanError, match="--pp-layers '1,x'"):
        parse_partition("1,x")
