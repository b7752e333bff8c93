"""distload/plan/bounds.py: a config.json claiming far more loop values (layers, experts) than the
checkpoint holds is refused before planning expands them, naming the config key and the real count."""

from __future__ import annotations

import time

import pytest

from distload.checkpoint.discover import discover
from distload.demo import make_demo_checkpoint
from distload.errors import PlanError
from distload.plan.bounds import check_loop_bounds, values_in_checkpoint
from distload.plan.build import build_plan
from distload.rules import rules_for
from distload.topology import Layout


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    index = discover(make_demo_checkpoint(tmp_path_factory.mktemp("demo") / "ckpt"))
    return index.tensors, index.config, rules_for(index.config)


def test_layers_found_in_the_checkpoint(demo):
    tensors, config, rules = demo
    assert values_in_checkpoint(tensors, {"model.layers.{layer}.mlp.down_proj.weight"}, "layer") == \
        set(range(config["num_hidden_layers"]))


def test_200000_layers_refused_in_planning_naming_the_key(demo):
    tensors, config, rules = demo
    claimed = {**config, "num_hidden_layers": 200000}
    started = time.monotonic()
    with pytest.raises(PlanError) as info:
        build_plan(tensors, claimed, rules, Layout(world=2, tp=2))
    message = str(info.value)
    assert "num_hidden_layers=200000" in message and f"holds {config['num_hidden_layers']}" in message, message
    assert time.monotonic() - started < 60  # generous: the point is that it ends, not how fast


def test_small_excess_left_to_the_missing_names(demo):
    tensors, config, rules = demo
    check_loop_bounds(tensors, rules, config)
    check_loop_bounds(tensors, rules, {**config, "num_hidden_layers": config["num_hidden_layers"] + 1})
    with pytest.raises(PlanError) as info:
        build_plan(tensors, {**config, "num_hidden_layers": config["num_hidden_layers"] + 1}, rules,
                   Layout(world=1, tp=1))
    assert "missing" in str(info.value)
