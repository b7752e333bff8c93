"""Rules files on disk: reading a family's TOML and merging in the families it `extends` (family.py parses the
merged tables into FamilyRules)."""

from __future__ import annotations

import tomllib
from importlib import resources
from pathlib import Path

from . import names
from ..errors import RuleError

TOP_KEYS = {"name", "architectures", "extends", "dims", "loops", "drop", "tie", "params", "expert_prefix", "sets",
            "remove", "drop_past", "mtp"}


def config_dir():
    """The shipped family files (distload/configs)."""
    return resources.files("distload.configs")


def _read_toml(path) -> dict:
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise RuleError(f"{path}: not valid TOML: {exc}") from None


def _parent_file(path, parent):
    """The file `extends = parent` names: next to the extending file first, else the shipped family."""
    if not isinstance(parent, str) or not parent or "/" in parent or "\\" in parent:
        raise RuleError(f"{path}: extends must name a family (a file stem such as \"llama\"), got {parent!r}")
    beside = path.parent / f"{parent}.toml" if isinstance(path, Path) else None
    if beside is not None and beside.is_file():
        return beside
    shipped = config_dir() / f"{parent}.toml"
    if not shipped.is_file():
        beside_text = f"{beside} does not exist, nor does" if beside is not None else "there is no"
        raise RuleError(f"{path}: extends {parent!r}, but {beside_text} a shipped configs/{parent}.toml")
    return shipped


def merged_tables(path, seen=()) -> dict:
    """A family file's tables with those of the families it extends merged in (its own entries win), `remove`
    applied; identity (name, architectures) never inherited."""
    data = _read_toml(path)
    unknown = set(data) - TOP_KEYS
    if unknown:
        raise RuleError(f"{path}: unknown keys {sorted(unknown)}; allowed: {sorted(TOP_KEYS)}")
    parent = data.pop("extends", None)
    if parent is None:
        if "remove" in data:
            raise RuleError(f"{path}: remove takes params away from the family it extends; this file extends none")
        return data
    if parent in seen:
        raise RuleError(f"{path}: 'extends' cycle through {parent!r}")
    base_path = _parent_file(path, parent)
    base = merged_tables(base_path, seen + (parent,))
    for key in ("dims", "loops", "params", "sets", "mtp"):
        base[key] = {**base.get(key, {}), **data.get(key, {})}
    for key in ("drop", "drop_past"):
        base[key] = list(base.get(key, [])) + list(data.get(key, []))
    removed = data.get("remove", [])
    if not isinstance(removed, list) or not all(isinstance(t, str) for t in removed):
        raise RuleError(f"{path}: remove must be a list of inherited param names, got {removed!r}")
    for target in removed:
        if target not in base["params"]:
            raise RuleError(f"{path}: remove names {target!r}, which {parent!r} does not define; inherited params: "
                            f"{names.describe(base['params'])}")
        if target in data.get("params", {}):
            raise RuleError(f"{path}: {target!r} is both removed and defined; keep one")
        del base["params"][target]
    base["tie"] = list(base.get("tie", [])) + list(data.get("tie", []))
    # Identity is never inherited: a family that extends another still names itself and its architectures.
    base["name"], base["architectures"] = data.get("name"), data.get("architectures")
    return base
