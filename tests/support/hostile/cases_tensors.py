"""Cases: tensors whose shape or dtype lies, damaged headers, damaged indexes (demo checkpoint: Llama,
hidden 256, intermediate 768, 8 heads, 2 kv heads, vocab 1000, bf16, three files)."""

from __future__ import annotations

import json

import torch

from .case import Case
from .st_files import damage_header, edit_entry, first_tensor, index, replace_tensor, write_index

L0 = "model.layers.0."
DOWN, O_PROJ, Q, K, V = L0 + "mlp.down_proj.weight", L0 + "self_attn.o_proj.weight", L0 + "self_attn.q_proj.weight", \
    L0 + "self_attn.k_proj.weight", L0 + "self_attn.v_proj.weight"
NORM, IN_NORM, POST_NORM = "model.norm.weight", L0 + "input_layernorm.weight", L0 + "post_attention_layernorm.weight"
EMBED, HEAD, UP, GATE = "model.embed_tokens.weight", "lm_head.weight", L0 + "mlp.up_proj.weight", L0 + "mlp.gate_proj.weight"


def _bf16(*shape):
    return torch.full(shape, 0.5, dtype=torch.bfloat16) if shape else torch.tensor(0.5, dtype=torch.bfloat16)


def _store(tensor, value):
    def build(ckpt, ws):
        replace_tensor(ckpt, tensor, value() if callable(value) else value)
        return [str(ckpt)]
    return build


def _relabel(tensor, dtype, shape=None):
    """Same bytes, another dtype in the header (and a shape that makes the byte count fit)."""
    def build(ckpt, ws):
        edit_entry(ckpt, tensor, dtype=dtype, **({"shape": shape} if shape else {}))
        return [str(ckpt)]
    return build


def _transposed(tensor, rows, cols):
    """The tensor's rows x cols stored as cols x rows (its transpose)."""
    def build(ckpt, ws):
        replace_tensor(ckpt, tensor, torch.randn(rows, cols).to(torch.bfloat16).t().contiguous())
        return [str(ckpt)]
    return build


def _header(fn):
    def build(ckpt, ws):
        damage_header(ckpt, fn)
        return [str(ckpt)]
    return build


def _set_first(key, value):
    def fn(header):
        header[first_tensor(header)][key] = value
        return header
    return fn


def _index_edit(fn):
    def build(ckpt, ws):
        value = fn(index(ckpt), ckpt)
        write_index(ckpt, value)
        return [str(ckpt)]
    return build


def _dot_slash(idx, ckpt):
    names = sorted(idx["weight_map"])
    for n in names[::2]:  # every other tensor of every file named "./file": one file, two spellings
        idx["weight_map"][n] = "./" + idx["weight_map"][n]
    return idx


def _wrong_file(idx, ckpt):
    files = sorted(set(idx["weight_map"].values()))
    idx["weight_map"][NORM] = next(f for f in files if f != idx["weight_map"][NORM])
    return idx


def _directory_file(idx, ckpt):
    (ckpt / "adir.safetensors").mkdir()
    idx["weight_map"][NORM] = "adir.safetensors"
    return idx


def _stray_file(ckpt, ws):
    from safetensors.torch import save_file

    save_file({"stray.weight": torch.zeros(4)}, str(ckpt / "zz-stray.safetensors"))
    return [str(ckpt)]


def _empty_file(size):
    def build(ckpt, ws):
        path = max(sorted(ckpt.glob("*.safetensors")), key=lambda p: p.stat().st_size)
        path.write_bytes(path.read_bytes()[:size])
        return [str(ckpt)]
    return build


SHAPE_AND_DTYPE = [
    Case("down-proj-transposed", _transposed(DOWN, 256, 768), names=(DOWN, "768", "256")),
    Case("o-proj-i16-relabel", _relabel(O_PROJ, "I16"), names=(O_PROJ, "I16")),
    Case("norm-300-elements", _store(NORM, _bf16(300)), names=(NORM, "300", "256")),
    Case("norm-zero-size", _store(NORM, _bf16(0)), names=(NORM, "256")),
    Case("norm-bool", _store(NORM, torch.ones(256, dtype=torch.bool)), names=(NORM, "BOOL")),
    Case("post-norm-f32-512-wide", _store(POST_NORM, torch.ones(512)), names=(POST_NORM, "512")),
    Case("embed-999-rows", _store(EMBED, _bf16(999, 256)), names=(EMBED, "999")),
    Case("lm-head-128-wide", _store(HEAD, _bf16(1000, 128)), names=(HEAD, "128")),
]

HEADERS = [
    Case("file-empty", _empty_file(0)),
    Case("header-dtype-lowercase", _header(_set_first("dtype", "bf16")), names=("bf16",)),
    Case("header-shape-negative", _header(_set_first("shape", [-1, 256])), names=("-1",)),
]

INDEXES = [
    Case("index-dot-slash-and-plain", _index_edit(_dot_slash), expect="ok"),
    Case("index-not-json", _index_edit(lambda i, c: '{"weight_map": {')),
    Case("index-names-wrong-file", _index_edit(_wrong_file), names=(NORM,)),
    Case("index-file-is-directory", _index_edit(_directory_file), names=("adir.safetensors",)),
]

CASES = SHAPE_AND_DTYPE + HEADERS + INDEXES

# Further cases of the same kinds: `python -m tests.support.hostile --all` runs them too (kept out of the suite's time).
EXTRA = [
    Case("q-proj-half-rows", _store(Q, _bf16(128, 256)), names=(Q, "128")),
    Case("v-proj-u8-relabel", _relabel(V, "U8", [64, 512]), names=(V, "U8")),
    Case("header-entry-no-dtype", _header(lambda h: {**h, first_tensor(h): {
        k: v for k, v in h[first_tensor(h)].items() if k != "dtype"}}), names=("dtype",)),
    Case("index-stray-file-not-listed", _stray_file, expect="ok"),
    Case("norm-2d", _store(NORM, _bf16(256, 1)), names=(NORM, "256")),
    Case("input-norm-i32-relabel", _relabel(IN_NORM, "I32", [128]), names=(IN_NORM, "128", "256")),  # shape first
    Case("o-proj-zero-rows", _store(O_PROJ, _bf16(0, 256)), names=(O_PROJ,)),
    Case("embed-i16-relabel", _relabel(EMBED, "I16"), names=(EMBED, "I16")),
    Case("header-length-zero", _header(lambda h: b"")),
    Case("header-offsets-reversed", _header(lambda h: {**h, first_tensor(h): {
        **h[first_tensor(h)], "data_offsets": h[first_tensor(h)]["data_offsets"][::-1]}})),
    Case("index-weight-map-list", _index_edit(lambda i, c: {**i, "weight_map": sorted(i["weight_map"])}),
         names=("weight_map",)),
    Case("norm-scalar", _store(NORM, _bf16()), names=(NORM,)),
    Case("k-proj-half-cols", _store(K, _bf16(64, 128)), names=(K, "128")),
    Case("up-proj-i64-relabel", _relabel(UP, "I64", [768, 64]), names=(UP, "I64")),
    Case("gate-proj-3d", _store(GATE, _bf16(768, 256, 1)), names=(GATE,)),
    Case("file-7-bytes", _empty_file(7)),
    Case("header-metadata-not-object", _header(lambda h: {**h, "__metadata__": 5}), names=("__metadata__",)),
    Case("header-shape-string", _header(_set_first("shape", "256"))),
    Case("header-offsets-float", _header(lambda h: {**h, first_tensor(h): {
        **h[first_tensor(h)], "data_offsets": [float(x) for x in h[first_tensor(h)]["data_offsets"]]}})),
    Case("header-invalid-utf8", _header(lambda h: b'{"\xff\xfe": 1}')),
    Case("header-entry-not-object", _header(lambda h: {**h, first_tensor(h): [1, 2]})),
    Case("index-no-weight-map", _index_edit(lambda i, c: {"metadata": {}}), names=("weight_map",)),
    Case("index-weight-map-empty", _index_edit(lambda i, c: {**i, "weight_map": {}})),
    Case("index-file-value-int", _index_edit(lambda i, c: {**i, "weight_map": {**i["weight_map"], NORM: 7}}),
         names=(NORM,)),
    Case("index-array-top-level", _index_edit(lambda i, c: json.dumps([i]))),
]
