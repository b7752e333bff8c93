"""distload.rules_check: the explanation a person writing a family reads (`distload rules check FILE CKPT`)."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest

from distload.checkpoint import discover
from distload.rules import rules_for
from distload.rules_check import check, explain

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture(scope="module")
def llama(dense_checkpoints):
    return dense_checkpoints["llama"]


def test_a_matching_family_explains_every_template_and_says_ok(llama):
    result = check(str(CONFIGS / "llama.toml"), llama, tp=2)
    assert result.ok, result.text
    text = result.text
    assert "head_dim = 16" in text and "kv_heads = 2   ('num_key_value_heads|num_attention_heads'" in text
    assert "model.layers.{layer}.self_attn.qkv_proj.weight  [qkv] x2: global [128, 64], rank 0 holds [64, 64]" in text
    # parts in their order in the param (q, k, v), with shapes and dtypes
    assert ("from model.layers.0.self_attn.q_proj.weight [64, 64] F32, model.layers.0.self_attn.k_proj.weight "
            "[32, 64] F32, model.layers.0.self_attn.v_proj.weight [32, 64] F32") in text
    assert "shape [hidden, intermediate] = [64, 128]   (hidden_size=64, intermediate_size=128)" in text
    assert text.splitlines()[-1].startswith("OK")


def test_a_wrong_family_names_what_is_missing_and_unmapped(llama, tmp_path):
    rules = tmp_path / "no_norm.toml"
    rules.write_text('name = "no_norm"\narchitectures = ["X"]\nextends = "llama"\n'
                     'remove = ["model.layers.{layer}.input_layernorm.weight"]\n')
    result = check(str(rules), llama)
    assert not result.ok
    assert "unmapped (no rule takes them): 2: 'model.layers.{0..1}.input_layernorm.weight'" in result.text


def test_a_refused_shape_is_shown_as_the_error(llama):
    index = discover(llama)
    entries = dict(index.tensors)
    e = entries["model.norm.weight"]
    entries[e.name] = replace(e, shape=(300,), nbytes=1200)
    result = explain(rules_for(index.config), entries, dict(index.config))
    assert not result.ok
    assert result.lines[-1].startswith("error: model.norm.weight has 300 rows but config.json says hidden = 64")


def test_the_command_line_prints_the_explanation_and_exits_by_its_verdict(llama, tmp_path, capsys):
    from distload.cli import main

    assert main(["rules", "check", str(CONFIGS / "llama.toml"), llama, "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "at tp 2" in out and out.splitlines()[-1].startswith("OK")
    assert main(["rules", "check", "auto", llama]) == 0      # the family config.json selects
    assert "(family llama)" in capsys.readouterr().out
    assert main(["rules", "check", "qwen2", llama]) == 1     # a shipped family by name, the wrong one
    assert "NOT OK" in capsys.readouterr().out


def test_the_command_line_names_an_unknown_rules_file(llama, capsys):
    from distload.cli import main

    assert main(["rules", "check", "no_such_family", llama]) == 1
    err = capsys.readouterr().err
    assert "no_such_family: no such file, nor a shipped family" in err and "llama" in err


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed: the comparison would run")
def test_against_vllm_without_vllm_says_where_to_run_it(llama, capsys):
    from distload.cli import main

    assert main(["rules", "check", "auto", llama, "--tp", "2", "--against", "vllm"]) == 1
    captured = capsys.readouterr()
    assert captured.out.splitlines()[-1].startswith("OK")   # the explanation still comes first
    assert "rules check --against vllm: vLLM is not importable in this interpreter" in captured.err
