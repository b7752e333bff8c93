"""Named templates for tensor names: `model.layers.{layer}.mlp.down_proj.weight`.

Rules name their variables (`{layer}`, `{expert}`) instead of rewriting numbers by position, so a rule
reads like the tensor name it stands for, and error messages can collapse long name lists back into
templates (`model.layers.{0..31}.mlp.down_proj.weight`).
"""

from __future__ import annotations

import re
from collections import defaultdict
from functools import lru_cache

_VAR = re.compile(r"\{(\w+)\}")


def variables(template: str) -> tuple[str, ...]:
    """The variable names of a template, in order of appearance."""
    return tuple(_VAR.findall(template))


@lru_cache(maxsize=4096)
def _pieces(template: str) -> tuple[str, ...]:
    """The template split at its variables: text, variable, text, ..., text (split once per template)."""
    return tuple(_VAR.split(template))


def _filled(template: str, values: dict, split_at: str | None = None) -> list[str]:
    """The template with its variables filled from `values`, as the texts between the occurrences of
    variable `split_at` (one text when it is None or absent)."""
    pieces = _pieces(template)
    texts, out = [], [pieces[0]]
    for i in range(1, len(pieces), 2):
        var = pieces[i]
        if var == split_at:
            texts.append("".join(out))
            out = []
        elif var not in values:
            raise KeyError(f"template {template!r} needs a value for {{{var}}}")
        else:
            out.append(str(values[var]))
        out.append(pieces[i + 1])
    texts.append("".join(out))
    return texts


def expand(template: str, **values: int) -> str:
    """Fill a template's variables: expand('a.{layer}.b', layer=3) -> 'a.3.b'."""
    return _filled(template, values)[0]


def expand_each(template: str, var: str, values, **fixed: int) -> list[str]:
    """[expand(template, **fixed, var=v) for v in values], the other variables filled once rather than per
    value (a layer's names over its hundreds of experts)."""
    if not values:
        return []
    texts = _filled(template, fixed, var)
    return [str(v).join(texts) for v in values]


@lru_cache(maxsize=4096)
def _pattern(template: str) -> re.Pattern:
    out, pos = [], 0
    for m in _VAR.finditer(template):
        out.append(re.escape(template[pos:m.start()]))
        out.append(f"(?P<{m.group(1)}>0|[1-9][0-9]*)")
        pos = m.end()
    out.append(re.escape(template[pos:]))
    return re.compile("".join(out))


def match(template: str, name: str) -> dict[str, int] | None:
    """The variable values that make `template` equal `name`, or None."""
    m = _pattern(template).fullmatch(name)
    return None if m is None else {k: int(v) for k, v in m.groupdict().items()}


def fullmatcher(template: str):
    """`fullmatcher(t)(name)` is truthy iff match(t, name) is not None: for filtering many names in one call."""
    return _pattern(template).fullmatch


@lru_cache(maxsize=4096)
def leading(template: str) -> re.Pattern:
    """Matches a name that is the template's or starts with one of its names and a dot; m[0] is that leading
    part (`model.layers.3` of `model.layers.3.mlp.down_proj.weight` under `model.layers.{layer}`)."""
    return re.compile(_pattern(template).pattern + r"(?=\.|\Z)")


def leads(template: str, tensor_names) -> set[str]:
    """The distinct leading parts (see `leading`) of the names under the template. A checkpoint lists a
    layer's (an expert's) names together: a name under the previous lead is that lead again, unmatched."""
    match, out, under = leading(template).match, set(), None
    for name in tensor_names:
        if under and name.startswith(under):
            continue
        m = match(name)
        if m is not None:
            out.add(m[0])
            under = m[0] + "."
    return out


_NUMBER = re.compile(r"(?<=\.)\d+(?=\.|$)")


def _ranges(numbers: list[int]) -> str:
    numbers = sorted(set(numbers))
    runs, start, prev = [], numbers[0], numbers[0]
    for n in numbers[1:] + [None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        runs.append(str(start) if start == prev else f"{start}..{prev}")
        if n is not None:
            start = prev = n
    return runs[0] if len(runs) == 1 and ".." not in runs[0] and len(numbers) == 1 else "{" + ",".join(runs) + "}"


def _fold(members: set[tuple[int, ...]]) -> list[list[frozenset[int]]]:
    """Exact folding: patterns (one value set per position) whose products partition `members`."""
    if not members or not next(iter(members)):
        return [[]]
    last_values: dict[tuple[int, ...], set[int]] = defaultdict(set)
    for m in members:
        last_values[m[:-1]].add(m[-1])
    prefixes_by_set: dict[frozenset[int], set[tuple[int, ...]]] = defaultdict(set)
    for prefix, values in last_values.items():
        prefixes_by_set[frozenset(values)].add(prefix)
    return [pattern + [values] for values, prefixes in prefixes_by_set.items() for pattern in _fold(prefixes)]


def collapse(names) -> list[str]:
    """Sorted names with numbered components folded: ['a.{0..31}.b', 'c']; for error messages.

    Exact: the folded patterns stand for precisely the given names, never for one that is not there.
    """
    groups: dict[str, set[tuple[int, ...]]] = defaultdict(set)
    for name in names:
        groups[_NUMBER.sub("#", name)].add(tuple(int(x) for x in _NUMBER.findall(name)))
    out = []
    for shape, members in groups.items():
        for pattern in _fold(members):
            it = iter(pattern)
            out.append(re.sub("#", lambda _: _ranges(list(next(it))), shape))
    return sorted(out)


def describe(names, limit: int = 12) -> str:
    """Quoted, collapsed, sorted name list for a message; long lists are cut with a count."""
    folded = collapse(names)
    shown = ", ".join(repr(n) for n in folded[:limit])
    return shown + (f", ... ({len(folded) - limit} more)" if len(folded) > limit else "")
