"""Target -> logical parts: the row ranges of its sources that the styles cut, sizes checked against config.json.

A part is one logical tensor (q, k, v; gate, up; one expert of a stacked tensor). Separate sources are
one part each; a source fused on disk is split into parts by sizes from config.json (`split` dims, or
heads x head_dim for qkv). Every size is checked here, so a checkpoint that disagrees with its
config.json is refused while planning, naming both numbers.
"""

from __future__ import annotations

from ..errors import PlanError, RuleError
from ..rules import FamilyRules
from .shard import Part, view2d
from .types import Target


def oriented_shape(shape, transposed: bool, what: str = "", stacked: bool = False) -> tuple[int, ...]:
    """A source's shape as the rule's styles see it: as stored, or with its last two axes swapped back; a
    stacked [experts, n] source (one vector per expert: GPT-OSS's expert biases) as [experts, n, 1]."""
    shape = tuple(shape)
    if stacked and len(shape) == 2 and not transposed:
        return shape + (1,)
    if not transposed:
        return shape
    if len(shape) < 2:
        raise PlanError(f"{what}: a transposed source has at least 2 dims, got {list(shape)}; "
                        f"drop `transposed` from the rule for 1-D tensors (biases, norms)")
    return shape[:-2] + (shape[-1], shape[-2])


def vector_experts(target, index) -> bool:
    """Is the target a stacked [experts, n] source, one vector per expert (seen as [experts, n, 1])?"""
    return target.rule.stacked and not target.rule.transposed and len(index[target.sources[0]].shape) == 2


def logical_parts(target: Target, sources: list[str], index: dict, rules: FamilyRules, config: dict,
                  row0: int = 0, rows: int | None = None) -> list[Part]:
    """The logical parts of one target (or of one expert of it: rows [row0, row0 + rows) of a stacked source)."""
    rule = target.rule
    style = rule.inner if rule.style == "expert" else rule.style
    entries = [index[s] for s in sources]
    where = f"{target.name} (rule {rule.style} in {rules.source})"
    shapes = [view2d(oriented_shape(e.shape, rule.transposed, f"{where}: {e.name}", rule.stacked)) for e in entries]
    if len({e.dtype for e in entries}) > 1:
        raise PlanError(f"{where}: parts have different dtypes "
                        + ", ".join(f"{e.name}={e.dtype}" for e in entries) + "; re-save the checkpoint with one dtype")
    if len({c for _, c in shapes}) > 1:
        raise PlanError(f"{where}: parts have different last dims "
                        + ", ".join(f"{e.name}{list(e.shape)}" for e in entries) + "; the checkpoint contradicts itself")
    cols = shapes[0][1]
    if rows is not None:
        return _stacked_expert_parts(where, sources, rules, config, row0, rows, cols, rule.split)
    if style == "qkv":
        return _qkv_parts(where, sources, shapes, rules, config, cols)
    if len(sources) == 1 and rule.split:
        sizes = [rules.dim(config, d) for d in rule.split]
        if sum(sizes) != shapes[0][0]:
            raise PlanError(f"{where}: {sources[0]} has {shapes[0][0]} rows but split {list(rule.split)} = {sizes} "
                            f"adds up to {sum(sizes)}; config.json and the checkpoint disagree")
        return [Part(sources[0], sum(sizes[:i]), n, cols) for i, n in enumerate(sizes)]
    if rule.split and len(rule.split) == len(sources):
        # Separate parts with declared sizes (e.g. gate/up = intermediate_size): check them against config.json.
        for src, (r, _), dim_name in zip(sources, shapes, rule.split):
            if r != rules.dim(config, dim_name):
                raise PlanError(f"{where}: {src} has {r} rows but config.json says {dim_name} = "
                                f"{rules.dim(config, dim_name)}; config.json and the checkpoint disagree")
    return [Part(s, 0, r, cols) for s, (r, _) in zip(sources, shapes)]


def _stacked_expert_parts(where: str, sources: list[str], rules: FamilyRules, config: dict, row0: int, rows: int,
                          cols: int, split: tuple[str, ...]) -> list[Part]:
    """One expert of a stacked source: its rows, split into parts by `split` dims when it has several."""
    (src,) = sources
    sizes = [rules.dim(config, d) for d in split] if split else [rows]
    if sum(sizes) != rows:
        raise PlanError(f"{where}: split {list(split)} = {sizes} does not add up to {rows} rows per expert of {src}")
    parts, at = [], row0
    for n in sizes:
        parts.append(Part(src, at, n, cols))
        at += n
    return parts


def _qkv_parts(where: str, sources: list[str], shapes, rules: FamilyRules, config: dict, cols: int) -> list[Part]:
    heads, kv = rules.dim(config, "heads"), rules.dim(config, "kv_heads")
    head_dim = rules.dim(config, "head_dim")
    want = [heads * head_dim, kv * head_dim, kv * head_dim]
    if len(sources) == 1:
        total = shapes[0][0]
        if total != sum(want):
            raise PlanError(f"{where}: {sources[0]} has {total} rows but config.json says "
                            f"(num_attention_heads {heads} + 2 x num_key_value_heads {kv}) x head_dim {head_dim} = "
                            f"{sum(want)}; config.json and the checkpoint disagree")
        return [Part(sources[0], sum(want[:i]), want[i], cols) for i in range(3)]
    if len(sources) != 3:
        raise RuleError(f"{where}: style qkv needs 3 parts (q, k, v) or one fused source, got {len(sources)}")
    for s, (r, _), w, label in zip(sources, shapes, want, ("num_attention_heads", "num_key_value_heads", "num_key_value_heads")):
        if r != w:
            raise PlanError(f"{where}: {s} has {r} rows but config.json says {label} x head_dim = {w}; "
                            f"config.json and the checkpoint disagree")
    return [Part(s, 0, r, cols) for s, (r, _) in zip(sources, shapes)]


def check_vocab(target: Target, parts: list[Part], rules: FamilyRules, config: dict) -> None:
    """A vocab-style param has config.json's vocab_size rows (when the family names that dim)."""
    if "vocab" in rules.dims:
        vocab = rules.dim(config, "vocab")
        if parts[0].rows != vocab:
            raise PlanError(f"{target.name} (rule vocab): {parts[0].source} has {parts[0].rows} rows but "
                            f"config.json vocab_size={vocab}; config.json and the checkpoint disagree")
