"""Rules as data: a family file `configs/<family>.toml` -> frozen dataclasses (DESIGN §4.1).

A family file maps checkpoint tensor names to target (serving) params and gives each target one
style. Sizes the styles need (heads, kv heads, head_dim, part sizes) are *named dims* read from the
checkpoint's config.json by small expressions, so a new dense architecture is a new TOML file.

    name = "llama"
    architectures = ["LlamaForCausalLM"]
    [dims]            # "a|b": first key present; "a/b": integer division; integers allowed
    head_dim = "head_dim|hidden_size/num_attention_heads"
    [loops]           # template variables and the dim giving their range
    layer = "layers"
    drop = ["model.layers.{layer}.self_attn.rotary_emb.inv_freq"]   # or "mtp.*": every name under a prefix
    [[tie]]           # target aliased to another when a config flag is true
    target = "lm_head.weight"
    to = "model.embed_tokens.weight"
    when = "tie_word_embeddings"
    [params."model.layers.{layer}.self_attn.qkv_proj.weight"]
    style = "qkv"
    parts = ["...q_proj.weight", "...k_proj.weight", "...v_proj.weight"]   # or one fused source

A family may `extends = "llama"`: it starts from that file's tables and adds or replaces entries.

Mixture-of-experts families add an `{expert}` loop and style `expert` (DESIGN §4.1): the param stacks the
experts a rank hosts, each cut by `inner` (column / row / merged / replicate) inside its expert group.

    [loops]
    expert = "experts"
    [params."model.layers.{layer}.mlp.experts.w13_weight"]
    style = "expert"
    inner = "merged"
    parts = ["...experts.{expert}.gate_proj.weight", "...experts.{expert}.up_proj.weight"]
    # The same param from another checkpoint form (here: experts stacked on disk, [experts, 2*I, H]); per
    # target, the first form whose tensors are all in the checkpoint is used (else the most complete one,
    # so that `missing` names what is really absent). Keys: parts, split, stacked, transposed; the rest is
    # inherited.
    [[params."model.layers.{layer}.mlp.experts.w13_weight".alternative]]
    stacked = true                         # dim 0 of the source is the expert; each expert cut as above
    parts = ["model.layers.{layer}.mlp.experts.gate_up_proj"]
    split = ["moe_inter", "moe_inter"]     # rows per expert of each logical part

`when = "flag"` keeps a param only where config.json's flag is true (`"!flag"`: false or absent, e.g. DeepSeek's
q_proj without q_lora_rank); `groups = "heads"` makes a column / row / merged cut keep whole heads.

`transposed = true` (a param or an alternative form): the checkpoint stores the param with its last two axes
swapped (GPT-2's Conv1D [in, out]; GPT-OSS's stacked experts [E, in, out]). Shapes, `split` and the style
are written for the serving orientation; each rank's shard is cut from the stored tensor and transposed once
it has landed (plan/transpose.py).

Params that exist only on some layers (an MoE model with a few dense MLP layers) name a *set* of loop
values computed from config.json, and say `only = "<set>"` or `unless = "<set>"`:

    [sets.moe_layers]
    loop = "layer"
    every = "sparse_step"      # dim n: values v with (v + 1) % n == 0 (Qwen's decoder_sparse_step)
    from = "first_dense"       # dim k: values v >= k (DeepSeek's first_k_dense_replace)
    skip = "mlp_only_layers"   # config.json key holding a list of values left out (absent: none)

`[mtp]` declares the multi-token-prediction layers after the decoder's, loaded on request (mtp.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from . import dims as dim_expr, sets as loop_sets, names
from ..errors import RuleError
from .sets import LoopSet
from .mtp import MtpRule, parse_mtp, with_mtp
from .files import config_dir, merged_tables
from .landing import KEYS as LANDING_KEYS, expressions, parse_landing

STYLES = ("replicate", "column", "row", "vocab", "merged", "qkv", "kv", "qkv_grouped", "qkv_packed", "expert",
          "rank0")
INNER_STYLES = ("column", "row", "merged", "replicate", "rank0")
PARAM_KEYS = {"style", "parts", "split", "inner", "pad_to", "stacked", "alternative", "only", "unless", "shape",
              "dtype", "when", "transposed", "groups", *LANDING_KEYS}
# float: the checkpoint's weight dtype; any-float: any float width; float32: any float width, delivered as F32
DTYPE_POLICIES = ("float", "any-float", "float32")
FORM_KEYS = {"parts", "split", "stacked", "transposed"}      # what an `alternative` checkpoint form may change


@dataclass(frozen=True)
class ParamRule:
    """One target param template: how its checkpoint parts are cut and combined."""
    target: str
    style: str
    parts: tuple[str, ...]          # checkpoint name templates; one entry + several logical parts = fused on disk
    split: tuple[str, ...] = ()     # dims naming the row count of each logical part of a fused source
    inner: str | None = None        # for style "expert": how each expert is cut inside its group
    pad_to: int = 64                # for style "vocab": pad the vocab to a multiple of lcm(pad_to, tp)
    stacked: bool = False           # for style "expert": the source already stacks all experts on dim 0
    alternatives: tuple["ParamRule", ...] = ()   # other checkpoint forms of the same target, in order
    only: str | None = None         # a [sets] name: the target exists only for those loop values
    unless: str | None = None       # a [sets] name: the target exists except for those loop values
    shape: tuple[str, ...] = ()     # full logical shape, one dim expression per axis (style expert: one expert)
    dtype: str = "float"            # DTYPE_POLICIES: which stored dtypes the param accepts
    when: str | None = None         # a config.json flag: the target exists only where it is true
    transposed: bool = False        # the sources store the param with its last two axes swapped (GPT-2 Conv1D)
    groups: str | None = None       # a dim: the cut keeps whole groups of that many (heads): tp must divide it
    stored_shape: tuple[str, ...] = ()   # landing.py: the checkpoint's shape of the same elements, served as shape
    permute: str | None = None      # landing.PERMUTES: rows reordered inside each head after landing
    transform: str | None = None    # landing.TRANSFORMS: values rewritten after landing (Jamba's -exp)

    @property
    def forms(self) -> tuple["ParamRule", ...]:
        """This rule and its alternative checkpoint forms, in order of preference."""
        return (self,) + self.alternatives


@dataclass(frozen=True)
class Tie:
    target: str
    to: str
    when: str


@dataclass(frozen=True)
class FamilyRules:
    name: str
    source: str                                   # file it came from, for messages
    architectures: tuple[str, ...]
    dims: dict[str, str] = field(default_factory=dict)
    loops: dict[str, str] = field(default_factory=dict)
    drop: tuple[str, ...] = ()
    drop_past: tuple[str, ...] = ()               # templates ignored past their loop's range (loop_sets.past_loops)
    ties: tuple[Tie, ...] = ()
    params: tuple[ParamRule, ...] = ()
    sets: dict[str, LoopSet] = field(default_factory=dict)
    mtp: MtpRule | None = None                    # the [mtp] table: multi-token-prediction layers (mtp.py)
    mtp_mode: str = "off"                         # mtp.MODES: what of them a load asks for (mtp.with_mtp)
    loop_spans: dict[str, tuple[int, int]] = field(default_factory=dict)   # loops run over [first, end), not range(dim)

    def loop_range(self, config: dict, var: str) -> range:
        """The values loop `var` takes for this config: range(its dim), or its span (the MTP layers on request)."""
        return range(*self.loop_spans[var]) if var in self.loop_spans else range(self.dim(config, self.loops[var]))

    def dim(self, config: dict, dim_name: str) -> int:
        """Evaluate a named dim against config.json; RuleError if no alternative is present."""
        if dim_name not in self.dims:
            raise RuleError(f"{self.source}: rule needs dim {dim_name!r}, which [dims] does not define")
        return self.dim_keys(config, dim_name)[0]

    def dim_keys(self, config: dict, dim_name: str) -> tuple[int, tuple[str, ...]]:
        """A named dim's value and the config.json keys it was computed from (for messages)."""
        if dim_name not in self.dims:
            raise RuleError(f"{self.source}: rule needs dim {dim_name!r}, which [dims] does not define")
        return dim_expr.evaluate(self.dims[dim_name], dim_expr.config_lookup(config), f"{self.source} [dims] {dim_name}")

    def members(self, config: dict, set_name: str, values: range) -> set[int]:
        """The values of `values` (the loop's range) that belong to [sets] `set_name` for this config."""
        return loop_sets.members(self.sets[set_name], lambda d: self.dim(config, d), config, values, self.source)


def eval_dim(expr: str, config: dict, where: str) -> int:
    """'a|b/c|8' or 'a * b + 1' -> the first alternative whose keys are all present in config, as an int."""
    return dim_expr.evaluate(expr, dim_expr.config_lookup(config), where)[0]


def _parse_form(table: dict, target: str, style: str, where: str, loops: dict, dims: dict, inner=None) -> dict:
    """The checkpoint-form keys of a param table (parts, split, stacked), validated."""
    raw_parts, raw_split = table.get("parts", [target]), table.get("split", [])
    if not isinstance(raw_parts, list) or not raw_parts or not all(isinstance(p, str) for p in raw_parts):
        raise RuleError(f"{where}: params.{target!r}: parts must be a non-empty list of names, got {raw_parts!r}")
    if not isinstance(raw_split, list) or not all(isinstance(d, str) for d in raw_split):
        raise RuleError(f"{where}: params.{target!r}: split must be a list of dim names, got {raw_split!r}")
    parts, split = tuple(raw_parts), tuple(raw_split)
    for dim_name in split:
        if dim_name not in dims:
            raise RuleError(f"{where}: params.{target!r}: split names dim {dim_name!r}, not in [dims]")
    for template in parts + (target,):
        for var in names.variables(template):
            if var not in loops:
                raise RuleError(f"{where}: {template!r} uses {{{var}}}, which [loops] does not define")
    stacked = table.get("stacked", False)
    if not isinstance(stacked, bool) or (stacked and style != "expert"):
        raise RuleError(f"{where}: params.{target!r}: stacked = true only applies to style expert")
    if style == "expert" and not stacked and not all("expert" in names.variables(p) for p in parts):
        raise RuleError(f"{where}: params.{target!r}: expert parts need {{expert}} in their names, or stacked = true")
    if stacked and (len(parts) != 1 or "expert" in names.variables(parts[0])):
        raise RuleError(f"{where}: params.{target!r}: a stacked form has one source without {{expert}} "
                        f"(dim 0 is the expert); use split for its logical parts")
    if (inner or style) == "merged" and len(parts) == 1 and not split:
        # Cut as one column, a fused [gate; up] would give rank 0 all gate rows and rank 1 all up rows.
        raise RuleError(f"{where}: params.{target!r}: a merged param with one source ({parts[0]!r}) needs "
                        f"split = [...], the rows of each fused part (e.g. [\"intermediate\", \"intermediate\"]); "
                        f"a source that is one part is style column")
    transposed = table.get("transposed", False)
    if not isinstance(transposed, bool) or (transposed and style in ("vocab", "replicate")):
        raise RuleError(f"{where}: params.{target!r}: transposed = true takes a cut style (column, row, merged, qkv, "
                        f"expert); a {style} param is loaded as stored")
    return dict(parts=parts, split=split, stacked=stacked, transposed=transposed)


def _parse_when(table: dict, target: str, where: str) -> str | None:
    when = table.get("when")
    if when is not None and (not isinstance(when, str) or not when.lstrip("!")):
        raise RuleError(f"{where}: params.{target!r}: when must name a config.json flag (\"!flag\": where it is "
                        f"false or absent), got {when!r}")
    return when


def flag_holds(when: str, config: dict) -> bool:
    """`when = "flag"`: config.json's flag is true (a non-zero size counts); `"!flag"`: it is false or absent. A
    flag may be a dotted path into a nested table (dims.config_value)."""
    if when.startswith("!"):
        return not dim_expr.config_value(config, when[1:])
    return bool(dim_expr.config_value(config, when))


def parse_rules(path) -> FamilyRules:
    """Parse and validate one family file (path or importlib resource)."""
    data = merged_tables(path)
    where = str(path)
    loops, dims = data.get("loops", {}), data.get("dims", {})
    sets = loop_sets.parse_sets(data, where)
    params = []
    for target, table in data.get("params", {}).items():
        if not isinstance(table, dict):
            raise RuleError(f"{where}: params.{target!r} must be a table")
        unknown = set(table) - PARAM_KEYS
        if unknown:
            raise RuleError(f"{where}: params.{target!r} has unknown keys {sorted(unknown)}; allowed: {sorted(PARAM_KEYS)}")
        style = table.get("style")
        if style not in STYLES:
            raise RuleError(f"{where}: params.{target!r} has style {style!r}; styles are {', '.join(STYLES)}")
        inner = table.get("inner")
        if style == "expert" and inner not in INNER_STYLES:
            raise RuleError(f"{where}: params.{target!r} (style expert) needs inner = one of {INNER_STYLES}")
        if style != "expert" and inner is not None:
            raise RuleError(f"{where}: params.{target!r}: 'inner' only applies to style expert")
        for key in ("only", "unless"):
            set_name = table.get(key)
            if set_name is None:
                continue
            if set_name not in sets:
                raise RuleError(f"{where}: params.{target!r}: {key} = {set_name!r}, which [sets] does not define")
            if sets[set_name].loop not in names.variables(target):
                raise RuleError(f"{where}: params.{target!r}: {key} = {set_name!r} is a set of "
                                f"{{{sets[set_name].loop}}} values, which the target name does not use")
        pad_to = table.get("pad_to", 64)
        if not isinstance(pad_to, int) or isinstance(pad_to, bool) or pad_to < 1:
            raise RuleError(f"{where}: params.{target!r}: pad_to must be a positive integer, got {pad_to!r}")
        groups = table.get("groups")
        if groups is not None and (groups not in dims or (inner or style) not in ("column", "row", "merged")):
            raise RuleError(f"{where}: params.{target!r}: groups names a [dims] entry (the heads a column, row or "
                            f"merged cut keeps whole), got {groups!r} on style {inner or style}")
        common = dict(target=target, style=style, inner=inner, pad_to=pad_to, groups=groups,
                      shape=expressions(table, "shape", target, where, dims), dtype=table.get("dtype", "float"),
                      **parse_landing(table, target, inner or style, where, dims))
        if common["dtype"] not in DTYPE_POLICIES:
            raise RuleError(f"{where}: params.{target!r}: dtype {common['dtype']!r}; allowed: {', '.join(DTYPE_POLICIES)}")
        alternatives = table.get("alternative", [])
        if isinstance(alternatives, dict):
            alternatives = [alternatives]
        forms = []
        for alt in alternatives:
            if not isinstance(alt, dict) or set(alt) - FORM_KEYS or "parts" not in alt:
                raise RuleError(f"{where}: params.{target!r}: each alternative is a table with parts and optionally "
                                f"split, stacked (the style is the param's); got {alt!r}")
            forms.append(ParamRule(**common, **_parse_form(alt, target, style, where, loops, dims, inner)))
        params.append(ParamRule(**common, **_parse_form(table, target, style, where, loops, dims, inner),
                                alternatives=tuple(forms), only=table.get("only"), unless=table.get("unless"),
                                when=_parse_when(table, target, where)))
    for table_name in ("dims", "loops"):
        bad = {k: v for k, v in data.get(table_name, {}).items() if not isinstance(v, str)}
        if bad:
            raise RuleError(f"{where}: [{table_name}] values must be strings (a TOML key after a [table] header "
                            f"belongs to that table: put top-level keys first); got {bad}")
    for template in data.get("drop_past", []):
        if not isinstance(template, str) or not names.variables(template) or \
                set(names.variables(template)) - set(loops):
            raise RuleError(f"{where}: drop_past entry {template!r} must be a name template using [loops] variables")
    ties = []
    for tie in data.get("tie", []):
        if set(tie) != {"target", "to", "when"}:
            raise RuleError(f"{where}: each [[tie]] needs exactly target, to, when; got {sorted(tie)}")
        ties.append(Tie(**tie))
    if not data.get("name") or not data.get("architectures"):
        raise RuleError(f"{where}: a family file needs 'name' and 'architectures'")
    return FamilyRules(name=data["name"], source=where, architectures=tuple(data["architectures"]),
                       dims=dict(data.get("dims", {})), loops=dict(data.get("loops", {})),
                       drop=tuple(data.get("drop", ())), drop_past=tuple(data.get("drop_past", ())), ties=tuple(ties),
                       params=tuple(params), sets=sets, mtp=parse_mtp(data.get("mtp"), where, dims, loops))


_shipped_cache: dict[tuple, list[FamilyRules]] = {}


def shipped_families() -> list[FamilyRules]:
    """Every shipped family; files starting with '_' are shared bases that only other files extend.

    Parsed once per process while the files stay the same (names, sizes, mtimes): every rank plans every
    load, and parsing all the families cost ~10 ms of each rank's plan phase."""
    files = sorted((p for p in config_dir().iterdir() if p.name.endswith(".toml")), key=lambda p: p.name)
    key = tuple((p.name, *_stamp(p)) for p in files)
    if key not in _shipped_cache:
        _shipped_cache.clear()
        _shipped_cache[key] = [parse_rules(p) for p in files if not p.name.startswith("_")]
    return list(_shipped_cache[key])


def _stamp(path) -> tuple[int, int]:
    try:
        st = os.stat(path)
        return st.st_size, st.st_mtime_ns
    except (OSError, TypeError):  # not a plain file (a zipped package): parsed every time is still right
        return -1, id(path)


def rules_for(config: dict, override: str | None = None, mtp_mode: str = "off") -> FamilyRules:
    """The family for a checkpoint: `override` (a TOML path) or the first shipped file listing its architecture;
    with its multi-token-prediction layers as `mtp_mode` asks (mtp.py)."""
    return with_mtp(_family_for(config, override), config, mtp_mode)


def _family_for(config: dict, override: str | None) -> FamilyRules:
    if override:
        path = Path(override)
        if not path.is_file():
            raise RuleError(f"--config {override}: no such file")
        return parse_rules(path)
    archs = config.get("architectures") or []
    families = shipped_families()
    for arch in archs:
        for fam in families:
            if arch in fam.architectures:
                return fam
    known = sorted(a for fam in families for a in fam.architectures)
    raise RuleError(f"config.json architectures {archs!r}: no shipped rules file lists it (known: {', '.join(known)}); "
                    f"write a configs/<family>.toml for it and pass --config PATH")
