"""Cases: topology numbers a user gets wrong, for a load and for inspect alike (inspect must refuse what a load
refuses, with the same message), and `--for vllm` problems, which must be found while planning, before any read."""

from __future__ import annotations

from .case import Case
from .st_files import edit_config

MOE = "mixtral"   # 4 experts, 2 layers (tests/hf_models.py)
INSPECT = "inspect"
READ_FAILS = (("DISTLOAD_FAULT", "read-error@read"),)   # any read of a weight byte fails: a refusal before is first


def _opts(*extra):
    def build(ckpt, ws):
        return [str(ckpt), *[a.replace("{out}", str(ws / "out")) for a in extra]]
    return build


def _inspect(case_id, *extra, base="demo", names=()):
    return Case(case_id, _opts(*extra), base=base, names=names, command=INSPECT, nproc=1)


def _architecture(name, *extra):
    def build(ckpt, ws):
        edit_config(ckpt, architectures=[name])
        return _opts(*extra)(ckpt, ws)
    return build


VLLM = "vllm==0.32.0"
SAVE = ("--save-sharded", "{out}", "--for")

LOAD = [
    Case("topo-pp-zero", _opts("--pp", "0"), names=("--pp",)),
    Case("topo-ep-zero", _opts("--tp", "1", "--ep", "0"), base=MOE, names=("--ep",)),
    Case("topo-pp-layers-not-summing", _opts("--tp", "1", "--pp", "2", "--pp-layers", "1,2"),
         names=("--pp-layers", "num_hidden_layers")),
    Case("topo-pp-layers-zero-stage", _opts("--tp", "1", "--pp", "2", "--pp-layers", "2,0"), names=("--pp-layers",)),
    Case("topo-pp-layers-three-for-pp-2", _opts("--tp", "1", "--pp", "2", "--pp-layers", "1,1,0"),
         names=("--pp-layers",)),
    Case("topo-tp-times-pp-past-world", _opts("--tp", "2", "--pp", "2"), names=("--pp",)),
]

INSPECTS = [
    _inspect("inspect-tp-zero", "--tp", "0", names=("--tp",)),
    _inspect("inspect-world-zero", "--world", "0", names=("--world",)),
    _inspect("inspect-world-negative", "--world", "-2", names=("--world",)),
    _inspect("inspect-local-world-zero", "--local-world", "0", "--world", "2", names=("--local-world",)),
    _inspect("inspect-world-not-whole-nodes", "--world", "4", "--local-world", "3", names=("4", "3", "node")),
    _inspect("inspect-ep-not-dividing-experts", "--tp", "1", "--ep", "3", "--world", "3", base=MOE,
             names=("--ep", "num_experts=4")),
    _inspect("inspect-pp-layers-not-summing", "--tp", "1", "--pp", "2", "--pp-layers", "1,2",
             names=("--pp-layers", "num_hidden_layers")),
    _inspect("inspect-rank-past-world", "--tp", "2", "--rank", "5", names=("--rank",)),
]

SERVING = [
    Case("for-vllm-unknown-version", _opts(*SAVE, "vllm==0.0.1"), env=READ_FAILS, names=("--for", "0.0.1")),
    Case("for-vllm-family-lacking", _architecture("MistralForCausalLM", *SAVE, VLLM), env=READ_FAILS,
         names=("--for", "MistralForCausalLM")),
    Case("for-vllm-pp-2", _opts("--tp", "1", "--pp", "2", *SAVE, VLLM), env=READ_FAILS, names=("--for", "tp")),
    Case("for-engine-unknown", _opts(*SAVE, "sglang"), env=READ_FAILS, names=("--for", "sglang")),
    Case("for-vllm-version-garbage", _opts(*SAVE, "vllm==latest"), env=READ_FAILS, names=("--for", "latest")),
]

CASES = LOAD + INSPECTS + SERVING

EXTRA: list[Case] = []
