"""Checks shared by the multi-rank tests: exact comparison with the oracle, tensor byte counts read
independently with safetensors, serving-layout modules on the meta device, and an audit hook that
records which checkpoint files a process opens (independent of distload's own counters)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


def differences(got: dict, want: dict, where: str) -> list[str]:
    """Names and tensors that differ (torch.equal, bit for bit); empty when identical."""
    problems = []
    if sorted(got) != sorted(want):
        problems.append(f"{where}: names differ: extra {sorted(set(got) - set(want))}, "
                        f"missing {sorted(set(want) - set(got))}")
    for name in sorted(set(got) & set(want)):
        if got[name].shape != want[name].shape or not torch.equal(got[name], want[name]):
            problems.append(f"{where}: {name} differs (got {list(got[name].shape)}, want {list(want[name].shape)})")
    return problems


def tensor_bytes(path: str) -> int:
    """Bytes of every tensor in a checkpoint, counted with safetensors itself."""
    from safetensors import safe_open

    from distload.dtypes import itemsize

    total = 0
    for f in Path(path).glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            for key in fh.keys():
                s = fh.get_slice(key)
                total += math.prod(s.get_shape()) * itemsize(s.get_dtype())
    return total


def module_from_specs(specs: dict) -> torch.nn.Module:
    """A serving-layout module on the meta device, nested like the param names; tied aliases share
    their target's Parameter, as a serving engine's module does."""
    from distload.dtypes import torch_dtype

    root = torch.nn.Module()

    def owner(name: str) -> tuple[torch.nn.Module, str]:
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        return mod, leaf

    for name, spec in sorted(specs.items()):
        if not spec.alias_of:
            mod, leaf = owner(name)
            mod.register_parameter(leaf, torch.nn.Parameter(
                torch.empty(spec.local_shape, dtype=torch_dtype(spec.dtype), device="meta"), requires_grad=False))
    for name, spec in sorted(specs.items()):
        if spec.alias_of:
            mod, leaf = owner(name)
            setattr(mod, leaf, root.get_parameter(spec.alias_of))
    return root


def record_weight_opens(roots) -> list[str]:
    """Install an audit hook recording every checkpoint weight file (under `roots`) this process opens."""
    opened, roots = [], tuple(str(Path(r).resolve()) for r in roots)

    def hook(event, args):
        if event == "open" and args and isinstance(args[0], (str, bytes)):
            path = args[0].decode() if isinstance(args[0], bytes) else args[0]
            if path.endswith(WEIGHT_SUFFIXES) and str(Path(path).resolve()).startswith(roots):
                opened.append(path)
    sys.addaudithook(hook)
    return opened
