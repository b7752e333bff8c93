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
    drop = ["model.layers.{layer}.self_attn.rotary_emb.inv_freq"]
    [[tie]]           # target aliased to another when a config flag is true
    target = "lm_head.weight"
    to = "model.embed_tokens.weight"
    when = "tie_word_embeddings"
    [params."model.layers.{layer}.self_attn.qkv_proj.weight"]
    style = "qkv"
    parts = ["...q_proj.weight", "...k_proj.weight", "...v_proj.weight"]   # or one fused source

A family may `extends = "llama"`: it starts from that file's tables and adds or replaces entries.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from . import names
from .errors import RuleError

STYLES = ("replicate", "column", "row", "vocab", "merged", "qkv", "expert")
INNER_STYLES = ("column", "row", "merged", "replicate")
TOP_KEYS = {"name", "architectures", "extends", "dims", "loops", "drop", "tie", "params", "expert_prefix"}
PARAM_KEYS = {"style", "parts", "split", "inner", "pad_to", "stacked"}


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
    ties: tuple[Tie, ...] = ()
    params: tuple[ParamRule, ...] = ()

    def dim(self, config: dict, dim_name: str) -> int:
        """Evaluate a named dim against config.json; RuleError if no alternative is present."""
        if dim_name not in self.dims:
            raise RuleError(f"{self.source}: rule needs dim {dim_name!r}, which [dims] does not define")
        return eval_dim(self.dims[dim_name], config, f"{self.source} [dims] {dim_name}")


def eval_dim(expr: str, config: dict, where: str) -> int:
    """'a|b/c|8' -> the first alternative whose keys are all present in config, as an int."""
    for alternative in expr.split("|"):
        terms = alternative.strip().split("/")
        values = []
        for term in terms:
            term = term.strip()
            if term.isdigit():
                values.append(int(term))
            elif isinstance(config.get(term), int) and not isinstance(config.get(term), bool):
                values.append(config[term])
            else:
                break
        else:
            value = values[0]
            for v in values[1:]:
                if v == 0 or value % v:
                    raise RuleError(f"{where}: {alternative!r} = {value}/{v} is not a whole number; check config.json")
                value //= v
            return value
    raise RuleError(f"{where}: config.json has none of {expr!r}; add the key to config.json or fix the rule")


def _config_dir():
    return resources.files("distload.configs")


def _read_toml(path) -> dict:
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise RuleError(f"{path}: not valid TOML: {exc}") from None


def _merged_tables(path, seen=()) -> dict:
    data = _read_toml(path)
    unknown = set(data) - TOP_KEYS
    if unknown:
        raise RuleError(f"{path}: unknown keys {sorted(unknown)}; allowed: {sorted(TOP_KEYS)}")
    parent = data.pop("extends", None)
    if parent is None:
        return data
    if parent in seen:
        raise RuleError(f"{path}: 'extends' cycle through {parent!r}")
    base_path = path.parent / f"{parent}.toml" if isinstance(path, Path) else _config_dir() / f"{parent}.toml"
    if not base_path.is_file():
        raise RuleError(f"{path}: extends {parent!r}, but {base_path} does not exist")
    base = _merged_tables(base_path, seen + (parent,))
    for key in ("dims", "loops", "params"):
        base[key] = {**base.get(key, {}), **data.get(key, {})}
    base["drop"] = list(base.get("drop", [])) + list(data.get("drop", []))
    base["tie"] = list(base.get("tie", [])) + list(data.get("tie", []))
    # Identity is never inherited: a family that extends another still names itself and its architectures.
    base["name"], base["architectures"] = data.get("name"), data.get("architectures")
    return base


def parse_rules(path) -> FamilyRules:
    """Parse and validate one family file (path or importlib resource)."""
    data = _merged_tables(path)
    where = str(path)
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
        raw_parts, raw_split = table.get("parts", [target]), table.get("split", [])
        if not isinstance(raw_parts, list) or not raw_parts or not all(isinstance(p, str) for p in raw_parts):
            raise RuleError(f"{where}: params.{target!r}: parts must be a non-empty list of names, got {raw_parts!r}")
        if not isinstance(raw_split, list) or not all(isinstance(d, str) for d in raw_split):
            raise RuleError(f"{where}: params.{target!r}: split must be a list of dim names, got {raw_split!r}")
        parts, split = tuple(raw_parts), tuple(raw_split)
        pad_to = table.get("pad_to", 64)
        if not isinstance(pad_to, int) or isinstance(pad_to, bool) or pad_to < 1:
            raise RuleError(f"{where}: params.{target!r}: pad_to must be a positive integer, got {pad_to!r}")
        for dim_name in split:
            if dim_name not in data.get("dims", {}):
                raise RuleError(f"{where}: params.{target!r}: split names dim {dim_name!r}, not in [dims]")
        loops = data.get("loops", {})
        for template in parts + (target,):
            for var in names.variables(template):
                if var not in loops:
                    raise RuleError(f"{where}: {template!r} uses {{{var}}}, which [loops] does not define")
        if style == "expert" and not all("expert" in names.variables(p) for p in parts) and not table.get("stacked"):
            raise RuleError(f"{where}: params.{target!r}: expert parts need {{expert}} in their names, or stacked = true")
        params.append(ParamRule(target=target, style=style, parts=parts, split=split, inner=inner,
                                 pad_to=pad_to, stacked=bool(table.get("stacked", False))))
    for table_name in ("dims", "loops"):
        bad = {k: v for k, v in data.get(table_name, {}).items() if not isinstance(v, str)}
        if bad:
            raise RuleError(f"{where}: [{table_name}] values must be strings (a TOML key after a [table] header "
                            f"belongs to that table: put top-level keys first); got {bad}")
    ties = []
    for tie in data.get("tie", []):
        if set(tie) != {"target", "to", "when"}:
            raise RuleError(f"{where}: each [[tie]] needs exactly target, to, when; got {sorted(tie)}")
        ties.append(Tie(**tie))
    if not data.get("name") or not data.get("architectures"):
        raise RuleError(f"{where}: a family file needs 'name' and 'architectures'")
    return FamilyRules(name=data["name"], source=where, architectures=tuple(data["architectures"]),
                       dims=dict(data.get("dims", {})), loops=dict(data.get("loops", {})),
                       drop=tuple(data.get("drop", ())), ties=tuple(ties), params=tuple(params))


def shipped_families() -> list[FamilyRules]:
    """Every shipped family; files starting with '_' are shared bases that only other files extend."""
    return [parse_rules(p) for p in sorted(_config_dir().iterdir(), key=lambda p: p.name)
            if p.name.endswith(".toml") and not p.name.startswith("_")]


def rules_for(config: dict, override: str | None = None) -> FamilyRules:
    """The family for a checkpoint: `override` (a TOML path) or the first shipped file listing its architecture."""
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
