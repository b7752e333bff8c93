"""Integer expressions of the rules language: `"head_dim|hidden_size/num_attention_heads"`, `"heads * head_dim"`.

An expression is one or more alternatives separated by `|`; the first alternative whose names all have an
integer value is used. An alternative is arithmetic over names and integers with `+ - * /` and parentheses
(`/` must divide exactly: a size that is not a whole number is a wrong config, never rounded). Names are
looked up by the caller (config.json keys for [dims], dim names for shapes), so this module knows no rules.
"""

from __future__ import annotations

import re

from ..errors import RuleError

_TOKEN = re.compile(r"\s*(?:(\d+)|([A-Za-z_]\w*)|(\S))")


def tokens(text: str) -> list[str]:
    """The tokens of one alternative; RuleError on a character the language does not have."""
    out = []
    for number, name, op in _TOKEN.findall(text):
        if op and op not in "+-*/()":
            raise RuleError(f"{text!r}: unexpected {op!r}; expressions use names, integers, + - * / and ( )")
        out.append(number or name or op)
    return out


def names_in(expr: str) -> set[str]:
    """Every name an expression mentions (in any alternative)."""
    return {t for alt in expr.split("|") for t in tokens(alt) if t[0].isalpha() or t[0] == "_"}


class _Absent(Exception):
    """A name of this alternative has no value: try the next alternative."""


class _Parser:
    def __init__(self, toks: list[str], lookup, where: str, alternative: str):
        self.toks, self.pos, self.lookup = toks, 0, lookup
        self.where, self.alternative, self.used = where, alternative, []

    def peek(self):
        return self.toks[self.pos] if self.pos < len(self.toks) else None

    def take(self):
        tok = self.peek()
        if tok is None:
            raise RuleError(f"{self.where}: {self.alternative!r} ends too early")
        self.pos += 1
        return tok

    def sum(self) -> int:
        value = self.product()
        while self.peek() in ("+", "-"):
            op, rhs = self.take(), self.product()
            value = value + rhs if op == "+" else value - rhs
        return value

    def product(self) -> int:
        value = self.factor()
        while self.peek() in ("*", "/"):
            op, rhs = self.take(), self.factor()
            if op == "*":
                value *= rhs
            elif rhs == 0 or value % rhs:
                raise RuleError(f"{self.where}: {self.alternative!r} = {value}/{rhs} is not a whole number; "
                                f"check config.json")
            else:
                value //= rhs
        return value

    def factor(self) -> int:
        tok = self.take()
        if tok == "(":
            value = self.sum()
            if self.take() != ")":
                raise RuleError(f"{self.where}: {self.alternative!r}: unbalanced parentheses")
            return value
        if tok.isdigit():
            return int(tok)
        if tok[0].isalpha() or tok[0] == "_":
            value = self.lookup(tok)
            if value is None:
                raise _Absent(tok)
            self.used.append(tok)
            return value
        raise RuleError(f"{self.where}: {self.alternative!r}: expected a name, an integer or '(', got {tok!r}")


def evaluate(expr: str, lookup, where: str) -> tuple[int, tuple[str, ...]]:
    """(value, names used) of the first alternative whose names `lookup` (name -> int | None) all knows."""
    for alternative in expr.split("|"):
        parser = _Parser(tokens(alternative), lookup, where, alternative.strip())
        try:
            value = parser.sum()
        except _Absent:
            continue
        if parser.peek() is not None:
            raise RuleError(f"{where}: {alternative.strip()!r}: unexpected {parser.peek()!r}")
        return value, tuple(dict.fromkeys(parser.used))
    raise RuleError(f"{where}: config.json has none of {expr!r}; add the key to config.json or fix the rule")


def config_lookup(config: dict):
    """Names as config.json keys holding integers (a bool is not a size)."""
    def lookup(name: str):
        value = config.get(name)
        return value if isinstance(value, int) and not isinstance(value, bool) else None
    return lookup
