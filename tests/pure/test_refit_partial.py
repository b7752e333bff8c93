"""Partial refits (issue 41), by planning only: an update that holds only part of a fused param is refused
naming it, the parts sent and the parts missing; an update of one layer plans exactly that layer's params (the
serving job's config was checked at its load, so fewer layers than config.json's is no refusal there)."""

from __future__ import annotations

import pytest

from distload.errors import PlanError
from distload.plan import DEFAULT_STAGING_BYTES
from distload.refit.one_source import update_plan
from distload.rules import rules_for
from distload.topology import Layout
from hf_metadata import decoder_config, decoder_shapes

LAYER = "model.layers.1."


@pytest.fixture(scope="module")
def model():
    config = decoder_config("llama", num_hidden_layers=4)   # 3 layers absent: more names than one layer's tensors
    return config, rules_for(config), {n: ("F32", s) for n, s in decoder_shapes(config).items()}


def _plan(model, meta, partial=True):
    config, family, _ = model
    return update_plan(meta, config, family, Layout(world=2, tp=2), DEFAULT_STAGING_BYTES, None, False, partial)


def test_a_fused_param_from_some_of_its_parts_is_refused_naming_them(model):
    meta = dict(model[2])
    del meta[LAYER + "mlp.up_proj.weight"]
    with pytest.raises(PlanError) as refused:
        _plan(model, meta)
    message = str(refused.value)
    for words in (LAYER + "mlp.gate_up_proj.weight", f"from '{LAYER}mlp.gate_proj.weight'",
                  f"without '{LAYER}mlp.up_proj.weight'", "send all parts of a fused param"):
        assert words in message, message


def test_one_layer_plans_exactly_that_layers_params(model):
    meta = {n: v for n, v in model[2].items() if n.startswith(LAYER)}
    plan = _plan(model, meta)
    want = {LAYER + p for p in ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "mlp.gate_up_proj.weight",
                                "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight")}
    assert [set(plan.specs[r]) for r in range(2)] == [want, want]
    assert set(plan.sources) == set(meta)


def test_a_whole_refit_lacking_layers_is_still_refused(model):
    meta = {n: v for n, v in model[2].items() if n.startswith(LAYER)}
    with pytest.raises(PlanError, match=r"the update lacks \d+ tensor\(s\) .*pass partial=True"):
        _plan(model, meta, partial=False)
