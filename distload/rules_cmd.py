"""`distload rules check FILE CKPT [--tp N] [--against vllm [--ep]]`: the command a person writing a family runs
(rules_check.py).

FILE is a rules file, or the name of a shipped family (`llama`), or `auto` (the family config.json's
architectures select). The explanation goes to stdout; the exit status is 0 when every checkpoint tensor is
mapped and every expected shape and dtype holds, 1 otherwise, so a script or CI can gate on it.

--against vllm (in an interpreter with vLLM): also load CKPT into vLLM's own model on N local processes, with
load_format="distload" and these rules and with vLLM's default loader, and compare every param of every rank
before and after vLLM's post-load processing (engines/vllm_oracle.py); exit 1 naming each param that differs.
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

    rules_file = resolve_rules_file(args.file, args.path)
    result = check(rules_file, args.path, tp=args.tp)
    print(result.text)
    if args.against is None:
        return 0 if result.ok else 1
    return 0 if against_vllm(rules_file, args.path, args.tp, args.ep) and result.ok else 1


def against_vllm(rules_file: str, checkpoint_dir: str, tp: int, ep: bool) -> bool:
    """Print vLLM's verdict on these rules for this checkpoint (engines/vllm_oracle.py); True when all is equal."""
    import importlib.util

    from .errors import DistloadError

    if importlib.util.find_spec("vllm") is None:
        raise DistloadError("rules check --against vllm: vLLM is not importable in this interpreter; run it where "
                            "vLLM is installed (pip install 'distload[vllm]', or the venv scripts/vllm_stage.sh makes)")
    from .engines.vllm_oracle import Case, compare

    (result,) = compare([Case(str(Path(checkpoint_dir).resolve()), str(Path(rules_file).resolve()), ep)], tp=tp)
    import vllm

    print(f"against vLLM {vllm.__version__}: its default loader and load_format=\"distload\" on {tp} processes")
    print("\n".join(result.lines()))
    print("OK: vLLM holds the same state with either loader" if result.ok else
          "NOT OK: distload's load differs from vLLM's own (the params above); fix the rules")
    return result.ok


def add_rules_parser(sub) -> None:
    """Register `rules check` under the CLI's subcommands (`sub`: argparse subparsers)."""
    rules = sub.add_parser("rules", help="tools for writing a rules file (configs/<family>.toml)")
    actions = rules.add_subparsers(dest="rules_command", required=True)
    p = actions.add_parser("check", help="explain how a rules file maps a checkpoint (headers only, no process group)",
                           description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", help="rules TOML file, a shipped family name, or 'auto'")
    p.add_argument("path", metavar="CKPT", help="checkpoint directory (config.json + safetensors)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size to plan for (default 1)")
    p.add_argument("--against", choices=["vllm"], default=None,
                   help="also compare with vLLM's own loader: load CKPT into vLLM's model with both, on --tp processes")
    p.add_argument("--ep", action="store_true", help="with --against vllm: vLLM's expert parallelism")
    p.set_defaults(fn=cmd_rules_check)
