"""Checks shared by the multi-rank tests: exact comparison with the oracle, tensor byte counts read
independently with safetensors, serving-layout modules on the meta device, and an audit hook that
records which checkpoint files a process opens (independent of distload's own counters)."""

from __future__ import annotations

import math
import sys
import textwrap
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


# A toy MoE family (router, merged w1/w3 and row w2 experts) for plan-level tests that need experts
# without a real model: rules body without the name/architectures header.
TOY_MOE_RULES = """\
    [dims]
    layers = "num_hidden_layers"
    experts = "num_local_experts"
    inter = "intermediate_size"
    [loops]
    layer = "layers"
    expert = "experts"
    [params."model.layers.{layer}.experts.w13_weight"]
    style = "expert"
    inner = "merged"
    parts = ["model.layers.{layer}.experts.{expert}.w1.weight", "model.layers.{layer}.experts.{expert}.w3.weight"]
    [params."model.layers.{layer}.experts.w2_weight"]
    style = "expert"
    inner = "row"
    parts = ["model.layers.{layer}.experts.{expert}.w2.weight"]
    [params."model.layers.{layer}.gate.weight"]
    style = "replicate"
    """


def toy_rules(tmp_path: Path, body: str):
    """Parse a rules body (dedented) as a family file named 'toy' for architecture 'Toy'."""
    import textwrap

    from distload.rules import parse_rules

    path = tmp_path / "toy.toml"
    path.write_text('name = "toy"\narchitectures = ["Toy"]\n' + textwrap.dedent(body))
    return parse_rules(path)


def cross_node_bytes(plan) -> list[int]:
    """Per rank, the bytes the plan sends it from a reader on another node (what crosses the network)."""
    layout, out = plan.layout, [0] * plan.layout.world
    for b in plan.buckets:
        for rank in range(layout.world):
            if layout.node(rank) != layout.node(b.reader):
                out[rank] += b.read_bytes if b.broadcast else b.recv_bytes[rank]
    return out


def assert_rows_stay_on_their_node(plan) -> None:
    """Rows that the ranks of only one node take are read by a reader on that node (when it has one), so only
    rows several nodes need cross between nodes; and the nodes read about the same bytes."""
    from distload.plan import clip

    layout = plan.layout
    reader_nodes = {layout.node(r) for r in layout.readers}
    shared = 0
    for b in plan.buckets:
        for c in b.chunks:
            src = plan.sources[c.source]
            nodes = {layout.node(d.rank) for d in src.deliveries if clip(d.piece, c.rows) is not None}
            if len(nodes) == 1 and nodes <= reader_nodes:
                assert nodes == {layout.node(b.reader)}, f"{c}: taken on node {nodes}, read on {layout.node(b.reader)}"
                continue
            shared += (c.rows[1] - c.rows[0]) * src.row_bytes
            # Rows some but not all nodes take, each group of takers on one node or two neighbours (an expert
            # group over two nodes): read on one of those nodes.
            widest_group = max(layout.node(s.ranks.last) - layout.node(s.ranks.first)
                               for s in src.shares if clip(s.piece, c.rows) is not None)
            if 1 < len(nodes) < len({layout.node(r) for r in range(layout.world)}) and nodes <= reader_nodes \
                    and widest_group <= 1:
                assert layout.node(b.reader) in nodes, f"{c}: taken on nodes {nodes}, read on {layout.node(b.reader)}"
    # What crosses is at most the shared rows, to each rank of another node.
    nodes = len({layout.node(r) for r in range(layout.world)})
    assert sum(cross_node_bytes(plan)) <= shared * (nodes - 1) * layout.local_world
    per_node = {}
    for b in plan.buckets:
        per_node[layout.node(b.reader)] = per_node.get(layout.node(b.reader), 0) + b.read_bytes
    if len(per_node) == nodes and len({sum(1 for r in layout.readers if layout.node(r) == n) for n in per_node}) == 1:
        biggest = max(s.nbytes for s in plan.sources.values())
        assert max(per_node.values()) - min(per_node.values()) <= 2 * biggest, per_node


MINIMAL = """\
name = "toy"
architectures = ["ToyForCausalLM"]
[dims]
layers = "num_hidden_layers"
[loops]
layer = "layers"
[params."model.layers.{layer}.w"]
style = "column"
"""


def write(tmp_path: Path, text: str, name: str = "toy.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path
