"""`distload rules check FILE CKPT [--tp N]`: the command a person writing a family runs (rules_check.py).

FILE is a rules file, or the name of a shipped family (`llama`), or `auto` (the family config.json's
architectures select). The explanation goes to stdout; the exit status is 0 when every checkpoint tensor is
mapped and every expected shape and dtype holds, 1 otherwise, so a script or CI can gate on it.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def resolve_rules_file(spec: str, checkpoint_dir: str) -> str:
    """A path to the rules file FILE names: itself, a shipped family of that name, or (auto) config.json's."""
    from .checkpoint import discover
    from .errors import RuleError
    from .rules import rules_for, shipped_families

    if spec == "auto":
        return rules_for(dict(discover(checkpoint_dir).config)).source
    if Path(spec).is_file():
        return spec
    for fam in shipped_families():
        if fam.name == spec:
            return fam.source
    known = ", ".join(sorted(f.name for f in shipped_families()))
    raise RuleError(f"rules check {spec}: no such file, nor a shipped family of that name (shipped: {known}; "
                    f"or pass auto to use the family config.json selects)")


def cmd_rules_check(args) -> int:
    from .rules_check import check

    result = check(resolve_rules_file(args.file, args.path), args.path, tp=args.tp)
    print(result.text)
    return 0 if result.ok else 1


def add_rules_parser(sub) -> None:
    """Register `rules check` under the CLI's subcommands (`sub`: argparse subparsers)."""
    rules = sub.add_parser("rules", help="tools for writing a rules file (configs/<family>.toml)")
    actions = rules.add_subparsers(dest="rules_command", required=True)
    p = actions.add_parser("check", help="explain how a rules file maps a checkpoint (headers only, no process group)",
                           description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", help="rules TOML file, a shipped family name, or 'auto'")
    p.add_argument("path", metavar="CKPT", help="checkpoint directory (config.json + safetensors)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size to plan for (default 1)")
    p.set_defaults(fn=cmd_rules_check)
