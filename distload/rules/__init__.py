"""Rules as data (DESIGN §4.1): family files `configs/<family>.toml` -> FamilyRules, and the language they use.

    family.py   a family file -> FamilyRules (params, styles, dims, loops, ties); rules_for picks one from config.json
    files.py    where family files live and how `extends` merges their tables
    names.py    named templates for tensor names (`model.layers.{layer}...`), and name lists collapsed for messages
    dims.py     integer expressions over config.json keys (`head_dim|hidden_size/num_attention_heads`)
    sets.py     subsets of a loop's values (`[sets]`: MoE layers, layer ranges)
    mtp.py      multi-token-prediction layers a family declares (`--mtp`)

Pure: no I/O beyond reading TOML and config.json, no process group.
"""

from .family import (DTYPE_POLICIES, INNER_STYLES, STYLES, FamilyRules, ParamRule, Tie, eval_dim, flag_holds,
                     parse_rules, rules_for, shipped_families)

__all__ = ["DTYPE_POLICIES", "INNER_STYLES", "STYLES", "FamilyRules", "ParamRule", "Tie", "eval_dim", "flag_holds",
           "parse_rules", "rules_for", "shipped_families"]
