"""Cases: a user's rules file (--config, `distload rules check`) whose expressions or syntax are wrong, and
`rules check` pointed at what is not a checkpoint."""

from __future__ import annotations

from pathlib import Path

from .case import Case

LLAMA_RULES = Path(__file__).resolve().parents[3] / "configs" / "llama.toml"
INTERMEDIATE = 'intermediate = "intermediate_size"'
DEEP = 5000   # parentheses: far past Python's recursion limit for a recursive-descent parser


def _rules_text(intermediate: str | None = None, broken_line: str | None = None) -> str:
    """The shipped Llama rules as a user's file, with its `intermediate` dim made `intermediate` and, if given,
    `broken_line` added at line 3 (a TOML syntax error the refusal must place)."""
    text = LLAMA_RULES.read_text()
    if intermediate is not None:
        text = text.replace(INTERMEDIATE, f"intermediate = {intermediate!r}".replace("'", '"'))
    if broken_line is not None:
        lines = text.splitlines()
        text = "\n".join(lines[:2] + [broken_line] + lines[2:]) + "\n"
    return text


def _load_with(**rules):
    def build(ckpt, ws):
        (ws / "rules.toml").write_text(_rules_text(**rules))
        return [str(ckpt), "--config", str(ws / "rules.toml")]
    return build


def _check_with(**rules):
    def build(ckpt, ws):
        (ws / "rules.toml").write_text(_rules_text(**rules))
        return [str(ws / "rules.toml"), str(ckpt)]
    return build


def _check_without_config(ckpt, ws):
    (ckpt / "config.json").unlink()
    return ["llama", str(ckpt)]


NESTED = "(" * DEEP + "intermediate_size" + ")" * DEEP
CHECK = "rules check"

CASES = [
    Case("rules-dims-nested-5000", _load_with(intermediate=NESTED), names=("rules.toml", "intermediate", "nest")),
    Case("rules-dims-divide-by-zero", _load_with(intermediate="intermediate_size / 0"),
         names=("rules.toml", "intermediate", "/0")),
    Case("rules-dims-unknown-name", _load_with(intermediate="intermediate_sizes"),
         names=("rules.toml", "intermediate_sizes")),
    Case("rules-dims-power-operator", _load_with(intermediate="intermediate_size ** 2"),
         names=("rules.toml", "intermediate", "*")),
    Case("rules-dims-empty", _load_with(intermediate=""), names=("rules.toml", "intermediate")),
    Case("rules-syntax-error-line-3", _load_with(broken_line="extends = [unclosed"), names=("rules.toml", "line 3")),
    Case("rules-check-nested-5000", _check_with(intermediate=NESTED), command=CHECK, nproc=1,
         names=("rules.toml", "intermediate", "nest")),
    Case("rules-check-syntax-error-line-3", _check_with(broken_line="name = = 1"), command=CHECK, nproc=1,
         names=("rules.toml", "line 3")),
    Case("rules-check-no-config-json", _check_without_config, command=CHECK, nproc=1, names=("config.json",)),
    Case("rules-check-no-such-dir", lambda ckpt, ws: ["llama", str(ws / "nowhere")], command=CHECK, nproc=1,
         names=("nowhere",)),
]

EXTRA: list[Case] = []
