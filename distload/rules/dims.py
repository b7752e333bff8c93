"""Integer expressions of the rules language: `"head_dim|hidden_size/num_attention_heads"`, `"heads * head_dim"`.

An expression is one or more alternatives separated by `|`; the first alternative whose names are all present is
used (`|` binds loosest; in parentheses it chooses inside them: `hidden_size / (n_head|num_attention_heads)`). An
alternative is arithmetic over names and integers with `+ - * /` and parentheses (`/` must divide
exactly: a size that is not a whole number is a wrong config, never rounded), and choices by a config.json flag,
`flag ? a : b` (C's conditional, lowest precedence, right to left: `new_arch ? kv : multi_query ? 1 : heads`; the
flag is true, or a non-zero integer; absent or null is false; only the chosen branch is evaluated). A name may
reach into a nested table of config.json with dots (`attn_config.kv_n_heads`, MPT / DBRX).

Only an absent name (or a null) moves on to the next alternative. Anything else is an error, never a silent fall
back: a present value that is not an integer (a flag used as a size, a float, a list), a division that is not
whole. Names are looked up by the caller (config.json keys for [dims], dim names for shapes), so this module knows
no rules.
"""

from __future__ import annotations

import re

from ..errors import RuleError

_TOKEN = re.compile(r"\s*(?:(\d+)|([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)|(\S))")
_OPERATORS = "+-*/()?:|"


def tokens(text: str) -> list[str]:
    """The tokens of one alternative; RuleError on a character the language does not have."""
    out = []
    for number, name, op in _TOKEN.findall(text):
        if op and op not in _OPERATORS:
            raise RuleError(f"{text!r}: unexpected {op!r}; expressions use names, integers, + - * / ( ), a|b "
                            f"and flag ? a : b")
        out.append(number or name or op)
    return out


def _is_name(tok: str | None) -> bool:
    return tok is not None and (tok[0].isalpha() or tok[0] == "_")


def names_in(expr: str) -> set[str]:
    """Every name an expression mentions (in any alternative, conditions included)."""
    return {t for t in tokens(expr) if _is_name(t)}


class _Absent(Exception):
    """A name of this alternative has no value: try the next alternative."""


class _Parser:
    def __init__(self, toks: list[str], lookup, where: str, alternative: str):
        self.toks, self.pos, self.lookup = toks, 0, lookup
        self.where, self.alternative, self.used, self.absent = where, alternative, [], []
        self.live = True   # False while skipping what is not evaluated (a branch not chosen): nothing is looked up

    def peek(self, ahead: int = 0):
        at = self.pos + ahead
        return self.toks[at] if at < len(self.toks) else None

    def take(self):
        tok = self.peek()
        if tok is None:
            raise RuleError(f"{self.where}: {self.alternative!r} ends too early")
        self.pos += 1
        return tok

    def alternatives(self) -> int:
        """`a|b|...`: the first alternative whose names are present (the others are skipped, not evaluated)."""
        while True:
            start, used = self.pos, len(self.used)
            try:
                value = self.choice()
            except _Absent as missing:
                self.absent.append(str(missing))
                self.pos, value = start, None
                del self.used[used:]
                self._skip()
            if value is not None and self.peek() == "|":
                while self.peek() == "|":
                    self.take()
                    self._skip()
            if value is not None:
                return value
            if self.peek() != "|":
                raise _Absent(self.absent[-1])
            self.take()

    def _skip(self) -> None:
        """Past one alternative without evaluating it."""
        live, self.live = self.live, False
        self.choice()
        self.live = live

    def choice(self) -> int:
        """`flag ? a : b`, or a sum."""
        if not (_is_name(self.peek()) and self.peek(1) == "?"):
            return self.sum()
        flag = self.take()
        self.take()
        chosen = self._flag(flag) if self.live else True
        live = self.live
        self.live = live and chosen
        yes = self.choice()
        if self.take() != ":":
            raise RuleError(f"{self.where}: {self.alternative!r}: `{flag} ? a : b` needs its ':'")
        self.live = live and not chosen
        no = self.choice()
        self.live = live
        return yes if chosen else no

    def _flag(self, name: str) -> bool:
        value = self.lookup(name)
        if value is not None and not isinstance(value, int):
            raise RuleError(f"{self.where}: {self.alternative!r}: {name} = {value!r} is not a flag")
        self.used.append(name)
        return bool(value)

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
            elif not self.live:
                continue
            elif rhs == 0 or value % rhs:
                raise RuleError(f"{self.where}: {self.alternative!r}: {value}/{rhs} is not a whole number; "
                                f"check config.json")
            else:
                value //= rhs
        return value

    def factor(self) -> int:
        tok = self.take()
        if tok == "(":
            value = self.alternatives()
            if self.take() != ")":
                raise RuleError(f"{self.where}: {self.alternative!r}: unbalanced parentheses")
            return value
        if tok.isdigit():
            return int(tok)
        if _is_name(tok):
            return self._size(tok) if self.live else 1
        raise RuleError(f"{self.where}: {self.alternative!r}: expected a name, an integer or '(', got {tok!r}")

    def _size(self, name: str) -> int:
        value = self.lookup(name)
        if value is None:
            raise _Absent(name)
        if isinstance(value, bool):
            raise RuleError(f"{self.where}: {self.alternative!r}: {name} is {str(value).lower()}, a flag, not a "
                            f"size; choose a size by it with `{name} ? a : b`")
        if not isinstance(value, int):
            # a present key of the wrong type is the config's fault, never taken as absent
            fix = int(value) if isinstance(value, str) and value.strip().isdigit() else "an integer"
            raise RuleError(f"{self.where}: {self.alternative!r}: {name} = {value!r} is not an integer: config.json "
                            f"has {name} as a {type(value).__name__}, where a size is a JSON number; write it as "
                            f'"{name}": {fix} in config.json')
        self.used.append(name)
        return value


def evaluate(expr: str, lookup, where: str) -> tuple[int, tuple[str, ...]]:
    """(value, names used) of the first alternative whose names `lookup` (name -> value, None when absent) has."""
    toks = tokens(expr)
    _check_nesting(toks, where, expr)
    parser = _Parser(toks, lookup, where, expr.strip())
    try:
        value = parser.alternatives()
    except _Absent:
        raise RuleError(f"{where}: {expr!r}: config.json has no {' / '.join(dict.fromkeys(parser.absent))} (one per "
                        f"alternative); add the key to config.json or fix the rule") from None
    if parser.peek() is not None:
        raise RuleError(f"{where}: {expr.strip()!r}: unexpected {parser.peek()!r}")
    return value, tuple(dict.fromkeys(parser.used))


MAX_NESTING = 32   # parentheses deep: far past any real rule, far below Python's recursion limit


def _check_nesting(toks: list[str], where: str, expr: str) -> None:
    """Refuse an expression nested past MAX_NESTING (parentheses, and `? :` chains, which nest too) before the
    recursive parser meets it: a Python RecursionError is no refusal."""
    depth = deepest = 0
    for tok in toks:
        depth += (tok == "(") - (tok == ")")
        deepest = max(deepest, depth)
    nesting = deepest + toks.count("?")
    if nesting > MAX_NESTING:
        raise RuleError(f"{where}: {expr.strip()[:40]!r}...: nests {nesting} deep (parentheses and `? :`); an "
                        f"expression may nest at most {MAX_NESTING}: write the rule flatter")


def config_value(config: dict, name: str):
    """config.json's value of `name`, a dotted path into nested tables (`attn_config.kv_n_heads`); None: absent."""
    value = config
    for key in name.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def config_lookup(config: dict):
    """Names as config.json keys (dotted paths into nested tables); their values as stored, None when absent."""
    return lambda name: config_value(config, name)
