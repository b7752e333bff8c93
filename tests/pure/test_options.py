"""Every option declared once (options.LoadOptions' fields): the command line's flags, the Python signatures of
load / load_into / inspect and vLLM's loader config are made from that declaration, so they cannot drift apart."""

from __future__ import annotations

import argparse
import dataclasses
import inspect as pyinspect

import pytest

import distload
from distload.cli import build_parser, load_options
from distload.errors import DistloadError
from distload.options import LOAD, PLAN, LoadOptions, declared, flag_of

INSPECT_ONLY = {"world", "local_world", "rank", "per_rank", "cluster"}   # where inspect looks from, not what is planned


def subcommand(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def dests(parser: argparse.ArgumentParser) -> set[str]:
    return {a.dest for a in parser._actions if a.dest not in ("help", "path")}


def names(scope=None) -> set[str]:
    return {f.name for f in declared(scope)}


def test_every_declared_option_is_a_flag_of_each_command_that_takes_it():
    for command in ("load", "demo", "verify"):
        got = dests(subcommand(command))
        assert names() <= got, (command, sorted(names() - got))
    assert dests(subcommand("load")) == names()
    assert dests(subcommand("inspect")) == names(PLAN) | INSPECT_ONLY
    flags = {s for a in subcommand("load")._actions for s in a.option_strings}
    assert {flag_of(f) for f in declared()} <= flags


def test_load_only_options_are_not_inspects():
    load_only = names() - names(PLAN)
    assert {"report", "save_sharded", "save_for", "progress"} <= load_only
    assert all(f.metadata["scope"] == LOAD for f in declared() if f.name in load_only)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["inspect", "ckpt", "--report", "r.json"])


def test_python_signatures_list_the_declared_options_with_their_defaults():
    defaults = {f.name: f.default for f in declared()}
    for fn, leading in ((distload.load, ["path"]), (distload.load_into, ["module", "path"])):
        params = pyinspect.signature(fn).parameters
        assert list(params)[:len(leading)] == leading
        assert {k: p.default for k, p in params.items() if k not in leading} == defaults, fn.__name__
    params = pyinspect.signature(distload.inspect).parameters
    assert set(params) == {"path", "world", "local_world"} | names(PLAN)


def test_the_command_lines_defaults_are_pythons():
    """A load with no flags is LoadOptions() exactly: the flags' defaults come from the declaration."""
    args = build_parser().parse_args(["load", "ckpt"])
    assert load_options(args) == LoadOptions(tuning=load_options(args).tuning)
    for f in declared():
        assert getattr(args, f.name) == f.default, f.name


def test_every_option_reaches_python_by_its_name():
    for f in declared():
        value = f.default if f.default is not dataclasses.MISSING else None
        assert getattr(LoadOptions.from_kwargs(**{f.name: value}), f.name) == value, f.name


def test_inspect_refuses_a_load_only_option_by_name():
    with pytest.raises(DistloadError, match=r"'report': option of a load, not of planning"):
        distload.inspect("ckpt", tp=2, report="r.json")
    with pytest.raises(DistloadError, match=r"'tpp' \(did you mean 'tp'\?\)"):
        distload.inspect("ckpt", tpp=2)


def test_engine_settable_options_are_declared():
    engine = names() & {f.name for f in declared(engine=True)}
    assert {"readers", "report", "staging_mib"} <= engine and "tp" not in engine   # the instance's groups give tp
