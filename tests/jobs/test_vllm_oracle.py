"""vLLM as the oracle of every shipped family (engines/vllm_oracle.py, `rules check --against vllm`): each family's
tiny checkpoint loaded into vLLM 0.32's own model at tp 2 (and with expert parallelism for the MoE families of issue
38), once with load_format="distload" and once with vLLM's default loader, every param of every rank compared before
and after vLLM's post-load processing. All cases run in one pair of processes (~20 s of imports, then a few seconds a
load). The matrix goes to bench-out/vllm_oracle_matrix.md (BENCHMARKS.md records it). The wrong rules of issue 38
end in a difference or a refusal naming the param: Llama-4 without its rotary permutation, GPT-NeoX cut as vLLM's
old native model did, BLOOM as plain qkv, Granite-MoE's fused experts without split, OLMo 2's norms cut per rank.
Needs vLLM in the interpreter (scripts/vllm_stage.sh)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed in this interpreter: scripts/vllm_stage.sh runs these")

ROOT = Path(__file__).resolve().parents[2]
# Every shipped family's tiny checkpoints (hf_models.py), hidden 128 so that vLLM's CPU attention (head_dim >= 32)
# builds; with expert parallelism: issue 38's MoE families.
EP_FAMILIES = ("llama4", "olmoe", "phimoe", "granitemoe", "granitemoeshared", "ernie4_5_moe", "jamba")
OVERRIDES = {"deepseek_v3": dict(topk_method="noaux_tc", scoring_func="sigmoid"), "gptj": dict(n_embd=128),
             "deepseek_v3_no_q_lora": dict(topk_method="noaux_tc", scoring_func="sigmoid")}
# name -> (a shipped rules file, the edits that make it wrong): each loads with the right shapes, or is refused
WRONG = {
    "llama4": ("llama4", [('permute = "rotary_halves"\n', "")]),                      # no rotary permutation
    "gpt_neox": ("gpt_neox", [('style = "column"\ngroups = "heads"\nshape = ["3 * hidden", "hidden"]\n',
                               'style = "qkv_packed"\n'),                           # vLLM's old native GPT-NeoX
                              ('heads = "num_attention_heads"\n', 'heads = "num_attention_heads"\n'
                                                                  'kv_heads = "num_attention_heads"\n')]),
    "bloom": ("bloom", [('query_key_value.weight"]\nstyle = "qkv_packed"', 'query_key_value.weight"]\nstyle = "qkv"')]),
    "granitemoe": ("granitemoe", [('split = ["expert_inter", "expert_inter"]\n', "")]),   # fused gate/up as a column
    "olmo2": ("olmo2", [('q_norm.weight"]\nstyle = "replicate"', 'q_norm.weight"]\nstyle = "column"')]),
}


def families() -> list[str]:
    from hf_models import FAMILIES, LAYOUT_FAMILIES, SERVED_FAMILIES

    return sorted(set(FAMILIES) | set(LAYOUT_FAMILIES) | set(SERVED_FAMILIES) | {"internlm2"})


def _checkpoint(family: str, root: Path) -> Path:
    from hf_models import FAMILIES, LAYOUT_FAMILIES, SERVED_FAMILIES, save_checkpoint, save_internlm2_checkpoint

    if family == "internlm2":
        return save_internlm2_checkpoint(root / family, hidden_size=128)
    spec = FAMILIES.get(family) or LAYOUT_FAMILIES.get(family) or SERVED_FAMILIES[family]
    sizes = {"hidden_size": 128, **({"head_dim": 32} if "head_dim" in spec else {})}
    return save_checkpoint(family, root / family, dtype=torch.bfloat16, **{**sizes, **OVERRIDES.get(family, {})})


def _wrong_rules(name: str, root: Path) -> Path:
    from distload.rules import shipped_families

    family, edits = WRONG[name]
    text = Path(next(f.source for f in shipped_families() if f.name == family)).read_text()
    for old, new in edits + [(f'name = "{family}"', f'name = "wrong_{name}"')]:
        assert old in text, f"{family}: the edit {old!r} no longer applies"
        text = text.replace(old, new, 1)
    path = root / f"wrong_{name}.toml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from distload.engines.vllm_oracle import Case, compare

    root = tmp_path_factory.mktemp("oracle")
    ckpts = {f: _checkpoint(f, root) for f in families()}
    cases = [Case(str(ckpts[f])) for f in families()] + [Case(str(ckpts[f]), ep=True) for f in EP_FAMILIES]
    cases += [Case(str(ckpts[WRONG[n][0]]), str(_wrong_rules(n, root))) for n in WRONG]
    out = dict(zip([(c.label, c.ep, c.rules is not None) for c in cases], compare(cases, tp=2)))
    write_matrix(out.values())
    return out


def write_matrix(results) -> None:
    """The family x (loaded / processed equal) table, for BENCHMARKS.md."""
    lines = ["| case | vLLM model | loaded (params, all ranks) | processed | seconds (distload / vLLM's loader) |",
             "|---|---|---|---|---|"]
    for r in results:
        if r.error is not None:
            lines.append(f"| {r.case.label} | {r.model or '-'} | not compared: {r.error[:160]} | | |")
            continue
        cells = [f"{r.compared[s]} " + ("equal" if not r.differ[s] else f"**{len(r.differ[s])} differ**")
                 for s in ("loaded", "processed")]
        lines.append(f"| {r.case.label} | {r.model} | {cells[0]} | {cells[1]} | "
                     f"{r.seconds['distload']} / {r.seconds['safetensors']} |")
    out = ROOT / "bench-out" / "vllm_oracle_matrix.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text("\n".join(lines) + "\n")


def _result(results, family: str, ep: bool = False, wrong: bool = False):
    return next(r for (label, e, w), r in results.items() if e == ep and w == wrong and
                Path(r.case.checkpoint).name == family)


# vLLM 0.32's CPU build does not build these tiny checkpoints (the matrix says why); every other family must compare.
NOT_BUILT = {"internlm2"}


@needs_vllm
@pytest.mark.parametrize("family", families())
def test_every_param_of_every_rank_is_what_vllms_own_loader_puts_there(results, family):
    result = _result(results, family)
    if family in NOT_BUILT:
        assert result.error is not None and result.model == "", "\n".join(result.lines())
        pytest.skip(f"vLLM 0.32's CPU build does not build {family}: {result.error}")
    assert result.ok, "\n".join(result.lines())


@needs_vllm
@pytest.mark.parametrize("family", EP_FAMILIES)
def test_with_expert_parallelism(results, family):
    result = _result(results, family, ep=True)
    assert result.ok, "\n".join(result.lines())


@needs_vllm
@pytest.mark.parametrize("name,param", [("llama4", "self_attn.qkv_proj.weight"),
                                        ("gpt_neox", "attention.query_key_value.weight"),
                                        ("bloom", "self_attention.query_key_value.weight")])
def test_a_wrong_rule_with_the_right_shapes_shows_as_a_difference_naming_the_param(results, name, param):
    result = _result(results, WRONG[name][0], wrong=True)
    assert result.error is None and not result.ok
    assert any(param in d for d in result.differ["loaded"]), "\n".join(result.lines())


@needs_vllm
@pytest.mark.parametrize("name,needle", [
    ("granitemoe", "block_sparse_moe.experts.w13_weight': a merged param with one source"),
    ("olmo2", "self_attn.q_norm.weight: vLLM [128], distload's shard [64]"),
])
def test_a_wrong_rule_vllm_cannot_take_is_refused_naming_the_param(results, name, needle):
    result = _result(results, WRONG[name][0], wrong=True)
    assert result.error is not None and needle in result.error, "\n".join(result.lines())
