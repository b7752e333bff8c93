"""Hostile checkpoints and failing ranks: every case ends every process, non-zero, naming the cause.

Each case runs the way a user runs distload: a real `torchrun -m distload load ...` job, or (faults under
the Python API) ranks started by torch.multiprocessing without torchrun's agent calling distload.load().
The hostile corpus is generated here from a tiny real checkpoint (nothing binary is committed); faults
mid-load come from distload's test hook DISTLOAD_FAULT (distload/faults.py).

Refusals due before the transfer run with DISTLOAD_FAULT=kill@transfer: a rank that got as far as the
transfer loop would be SIGKILLed, so an error naming the cause on every rank also proves the job was
refused before any bucket moved. All jobs start from one module fixture, a few at a time (torchrun mostly waits); each case is
then its own test of its own exit code, time and message.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch

LIMIT_S = 90            # the bound on every case, end to end (asserted on measured wall time)
KILL_AFTER_S = 150      # the harness' own limit, so a hanging job fails the test instead of hanging CI
PG_TIMEOUT = "30"       # --timeout for every job: a survivor must give up on a silent peer by then
JOBS_AT_ONCE = 3
BEFORE_TRANSFER = "kill@transfer"
ERROR_LINE = re.compile(r"^distload: error on rank (\d+): (.*)$", re.M)


# ----------------------------------------------------------------------------------------------------
# Writing hostile safetensors files


def _read_st(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write_st(path: Path, header: dict | bytes, data: bytes, claimed_length: int | None = None) -> None:
    text = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    length = len(text) if claimed_length is None else claimed_length
    path.write_bytes(length.to_bytes(8, "little") + text + data)


def _tensors_by_offset(header: dict) -> list[str]:
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])


def _index(ckpt: Path) -> dict:
    return json.loads((ckpt / "model.safetensors.index.json").read_text())


def _write_index(ckpt: Path, index: dict) -> None:
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))


def _victim(ckpt: Path) -> Path:
    """The weight file with the most tensors (overlaps and gaps need at least two)."""
    counts: dict[str, int] = {}
    for f in _index(ckpt)["weight_map"].values():
        counts[f] = counts.get(f, 0) + 1
    return ckpt / max(sorted(counts), key=counts.get)


def _victim_header(ckpt: Path) -> tuple[Path, dict, bytes, list[str]]:
    """The victim file, its header and data, and its tensor names in file order."""
    path = _victim(ckpt)
    header, data = _read_st(path)
    return path, header, data, _tensors_by_offset(header)


def _drop_tensors(ckpt: Path, names: list[str]) -> None:
    from safetensors.torch import load_file, save_file

    index = _index(ckpt)
    for f in sorted({index["weight_map"][n] for n in names}):
        tensors = {k: v for k, v in load_file(ckpt / f).items() if k not in names}
        save_file(tensors, str(ckpt / f), metadata={"format": "pt"})
    for n in names:
        del index["weight_map"][n]
    _write_index(ckpt, index)


def _add_tensor(ckpt: Path, name: str, value: torch.Tensor, file: str = "model-extra.safetensors",
                index: bool = True) -> None:
    from safetensors.torch import save_file

    save_file({name: value}, str(ckpt / file), metadata={"format": "pt"})
    if index:
        idx = _index(ckpt)
        idx["weight_map"][name] = file
        _write_index(ckpt, idx)


def _edit_config(ckpt: Path, **changes) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    config.update(changes)
    (ckpt / "config.json").write_text(json.dumps(config))


class _RunsCode:
    """Unpickling this calls open(marker, "w"): a file appears if a loader ever executes the pickle."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _block_fp8(src: Path, out: Path, block: int) -> None:
    """A block-FP8 copy of `src` (every layer linear FP8 with weight_scale_inv, config says so)."""
    from safetensors.torch import load_file, save_file

    from distload.kernels import quantize_fp8_block_reference

    shutil.copytree(src, out)
    index = _index(out)
    for f in sorted(out.glob("*.safetensors")):
        tensors = {}
        for n, w in load_file(f).items():
            if re.match(r"model\.layers\.\d+\..*_proj\.weight$", n):
                w, tensors[n + "_scale_inv"] = quantize_fp8_block_reference(w, (block, block))
                index["weight_map"][n + "_scale_inv"] = f.name
            tensors[n] = w
        save_file(tensors, str(f), metadata={"format": "pt"})
    _write_index(out, index)
    _edit_config(out, quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                           "weight_block_size": [block, block]})


# ----------------------------------------------------------------------------------------------------
# The corpus: each builder gets a fresh copy of a base checkpoint (or an empty dir) and returns the
# command line after `distload load`, plus what every rank's error must name.


@dataclass(frozen=True)
class Case:
    id: str
    build: Callable        # (ckpt dir, workspace) -> (args after `load`, list of strings the message names)
    base: str = "llama"    # which base checkpoint the case starts from ("" = an empty directory)
    nproc: int = 2
    fault: str = BEFORE_TRANSFER
    ok: bool = False       # the one corpus case that must load (exit 0)
    before_group: bool = False  # refused while reading the topology, before any process group exists
    after: str = ""        # id of a case whose results (a sharded save) this one needs
    same_text: bool = True  # every rank prints the very same message (else: each names the cause)


def _truncated(ckpt, ws):
    f = _victim(ckpt)
    f.write_bytes(f.read_bytes()[:-100])
    return [str(ckpt)], [f.name, "run past", "truncated"]


def _header_past_eof(ckpt, ws):
    path, header, data, _ = _victim_header(ckpt)
    size = path.stat().st_size
    _write_st(path, header, data, claimed_length=size)  # the whole file's size: 8 bytes too many at least
    return [str(ckpt)], [path.name, "runs past the end", str(size)]


def _header_huge(ckpt, ws):
    path, header, data, _ = _victim_header(ckpt)
    _write_st(path, header, data, claimed_length=2**62)
    return [str(ckpt)], [path.name, f"header length {2**62}", "exceeds"]


def _header_not_json(ckpt, ws):
    path, _, data, _ = _victim_header(ckpt)
    _write_st(path, b'{"model.norm.weight": {"dtype": "F32", ', data)
    return [str(ckpt)], [path.name, "not valid JSON"]


def _header_not_object(ckpt, ws):
    path, _, data, _ = _victim_header(ckpt)
    _write_st(path, b'["model.norm.weight", "F32"]', data)
    return [str(ckpt)], [path.name, "must be a JSON object", "list"]


def _header_duplicate_key(ckpt, ws):
    path, header, data, order = _victim_header(ckpt)
    items = list(header.items()) + [(order[-1], header[order[-1]])]  # json.loads would silently keep one
    _write_st(path, ("{" + ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in items) + "}").encode(), data)
    return [str(ckpt)], [path.name, "duplicate key", order[-1]]


def _offsets_out_of_bounds(ckpt, ws):
    path, header, data, order = _victim_header(ckpt)
    begin, end = header[order[-1]]["data_offsets"]
    header[order[-1]]["data_offsets"] = [begin + len(data), end + len(data)]
    _write_st(path, header, data)
    return [str(ckpt)], [path.name, order[-1], "run past"]


def _offsets_overlap(ckpt, ws):
    path, header, data, order = _victim_header(ckpt)
    begin, end = header[order[1]]["data_offsets"]
    shift = begin - header[order[0]]["data_offsets"][0]
    header[order[1]]["data_offsets"] = [begin - shift, end - shift]  # starts where the first one starts
    _write_st(path, header, data)
    return [str(ckpt)], [path.name, "overlaps"]


def _offsets_gap(ckpt, ws):
    path, header, data, order = _victim_header(ckpt)
    begin, end = header[order[-1]]["data_offsets"]
    header[order[-1]]["data_offsets"] = [begin + 8, end + 8]
    _write_st(path, header, data[:begin] + bytes(8) + data[begin:])  # 8 stray bytes before the last tensor
    return [str(ckpt)], [path.name, "8-byte gap"]


def _byte_count(ckpt, ws):
    path, header, data, order = _victim_header(ckpt)
    header[order[0]]["shape"][0] -= 1
    _write_st(path, header, data)
    return [str(ckpt)], [path.name, order[0], "needs"]


def _unknown_dtype(ckpt, ws):
    path, header, data, order = _victim_header(ckpt)
    header[order[0]]["dtype"] = "Q4_K"
    _write_st(path, header, data)
    return [str(ckpt)], [path.name, "'Q4_K' is not supported"]


def _outside_file(ckpt, ws) -> Path:
    """A real, valid weight file outside the checkpoint directory (what an index must not reach)."""
    outside = ws / "outside"
    outside.mkdir()
    shutil.copy(_victim(ckpt), outside / "stolen.safetensors")
    return outside / "stolen.safetensors"


def _point_index_at(ckpt, target: str) -> None:
    index = _index(ckpt)
    index["weight_map"]["model.norm.weight"] = target
    _write_index(ckpt, index)


def _index_missing_file(ckpt, ws):
    _point_index_at(ckpt, "model-00009-of-00009.safetensors")
    return [str(ckpt)], ["model-00009-of-00009.safetensors", "missing"]


def _index_absolute(ckpt, ws):
    _point_index_at(ckpt, str(_outside_file(ckpt, ws)))
    return [str(ckpt)], ["stolen.safetensors", "absolute"]


def _index_dotdot(ckpt, ws):
    _outside_file(ckpt, ws)
    _point_index_at(ckpt, "../outside/stolen.safetensors")
    return [str(ckpt)], ["../outside/stolen.safetensors", "'..'"]


def _index_symlink(ckpt, ws):
    (ckpt / "model-link.safetensors").symlink_to(_outside_file(ckpt, ws))
    _point_index_at(ckpt, "model-link.safetensors")
    return [str(ckpt)], ["model-link.safetensors", "symlink", "outside the checkpoint"]


def _tensor_in_two_files(ckpt, ws):
    (ckpt / "model.safetensors.index.json").unlink()  # without an index, the files themselves must not clash
    _add_tensor(ckpt, "model.norm.weight", torch.ones(64), index=False)
    return [str(ckpt)], ["model.norm.weight", "two files", "model-extra.safetensors"]


def _pickle_runs_code(ckpt, ws):
    marker = ws / "pickle-ran.marker"
    shutil.copy(ws.parent / "base-llama" / "config.json", ckpt / "config.json")
    torch.save({"model.embed_tokens.weight": _RunsCode(str(marker))}, ckpt / "pytorch_model.bin")
    return [str(ckpt)], ["pytorch_model.bin", "refusing to load", "weights_only"]


def _config_missing(ckpt, ws):
    (ckpt / "config.json").unlink()
    return [str(ckpt)], ["config.json is missing", "--hf-config"]


def _config_contradicts(ckpt, ws):
    _edit_config(ckpt, num_key_value_heads=1)  # k_proj / v_proj hold 2 heads of 16 rows
    return [str(ckpt)], ["k_proj.weight has 32 rows", "config.json", "num_key_value_heads"]


def _tensor_missing(ckpt, ws):
    _drop_tensors(ckpt, [f"model.layers.{i}.mlp.down_proj.weight" for i in (0, 1)])
    return [str(ckpt)], ["missing 2 tensor(s)", "model.layers.{0..1}.mlp.down_proj.weight"]


def _tensor_unexpected(ckpt, ws):
    _add_tensor(ckpt, "model.layers.0.mlp.surprise.weight", torch.ones(4, 4))
    return [str(ckpt)], ["unexpected 1 tensor(s)", "model.layers.0.mlp.surprise.weight", "--no-strict"]


def _tensor_unexpected_allowed(ckpt, ws):
    _add_tensor(ckpt, "model.layers.0.mlp.surprise.weight", torch.ones(4, 4))
    return [str(ckpt), "--no-strict"], ["model.layers.0.mlp.surprise.weight"]


# Impossible topologies: refused while planning, with the choices that work.

def _tp_heads(ckpt, ws):
    return [str(ckpt)], ["num_attention_heads=4", "tp=3", "try tp 1, 2, 4"]


def _tp_kv_heads(ckpt, ws):
    return [str(ckpt)], ["num_key_value_heads=3", "tp=2", "try tp 1, 3, 6"]


def _tp_intermediate(ckpt, ws):
    return [str(ckpt)], ["gate_proj.weight=129", "tp=2", "try tp 1, 3, 43"]


def _tp_block(ckpt, ws):
    return [str(ckpt)], ["block FP8 [32, 32]", "try tp 1"]


def _ep_world(ckpt, ws):
    return [str(ckpt), "--tp", "1", "--ep", "3"], ["--ep 3 must divide the world size 4", "try --ep 1, 2, 4"]


def _ep_experts(ckpt, ws):
    return [str(ckpt), "--tp", "1", "--ep", "3"], ["num_experts=4", "ep=3", "try --ep 1"]


# Integrity, opt-in.

def _checksums_ok(ckpt, ws):
    _write_checksums(ckpt)
    return [str(ckpt), "--verify-checksums", "--check-finite", "--save-sharded", str(ws / "saved")], []


def _write_checksums(ckpt: Path) -> None:
    lines = [f"{hashlib.sha256(f.read_bytes()).hexdigest()}  {f.name}" for f in sorted(ckpt.glob("*.safetensors"))]
    (ckpt / "checksums").write_text("\n".join(lines) + "\n")


def _checksum_mismatch(ckpt, ws):
    _write_checksums(ckpt)
    f = _victim(ckpt)
    raw = bytearray(f.read_bytes())
    raw[-5] ^= 0x40  # one flipped bit in the last tensor: the header still parses
    f.write_bytes(bytes(raw))
    return [str(ckpt), "--verify-checksums"], ["--verify-checksums", f.name, "but checksums says"]


def _nonfinite(ckpt, ws):
    from safetensors.torch import load_file, save_file

    name = "model.layers.1.mlp.down_proj.weight"
    f = ckpt / _index(ckpt)["weight_map"][name]
    tensors = load_file(f)
    tensors[name][3, 5] = float("nan")
    tensors[name][60, 100] = float("inf")
    save_file(tensors, str(f), metadata={"format": "pt"})
    return [str(ckpt), "--check-finite"], ["--check-finite", name, "1 NaN, 0 Inf", "0 NaN, 1 Inf"]


def _saved_copy(ws, name: str) -> Path:
    """A private copy of the sharded save made by case 'checksums-ok' (the same bytes, our own dir)."""
    dst = ws / name
    shutil.copytree(ws.parent / "checksums-ok" / "saved", dst)
    return dst


def _sharded_tampered(ckpt, ws):
    saved = _saved_copy(ws, "saved")
    f = saved / "rank-00001-of-00002.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-5] ^= 0x40
    f.write_bytes(bytes(raw))
    return [str(saved), "--verify-checksums"], ["rank-00001-of-00002.safetensors", "sha256"]


# Faults mid-load under torchrun (each names the failing rank and the cause; the fault says where).

def _fault_read_error(ckpt, ws):
    return [str(ckpt)], ["rank 0", "Input/output error", "model-0000"]


def _fault_read_error_owners(ckpt, ws):
    # --readers owners: every rank reads its own pieces, so a non-zero rank's read can fail too
    return [str(ckpt), "--readers", "owners"], ["rank 1", "Input/output error", "model-0000"]


def _fault_raise_nonreader(ckpt, ws):
    return [str(ckpt), "--save-sharded", str(_saved_copy(ws, "previous"))], ["rank 1", "RuntimeError: injected fault"]


def _over_previous_save(ckpt, ws):
    return [str(ckpt), "--save-sharded", str(_saved_copy(ws, "previous"))], []


def _fault_hang(ckpt, ws):
    return [str(ckpt)], ["no word from rank 1"]


CASES = [
    Case("truncated-file", _truncated),
    Case("header-length-past-eof", _header_past_eof),
    Case("header-length-2^62", _header_huge),
    Case("header-not-json", _header_not_json),
    Case("header-not-object", _header_not_object),
    Case("header-duplicate-key", _header_duplicate_key),
    Case("offsets-out-of-bounds", _offsets_out_of_bounds),
    Case("offsets-overlap", _offsets_overlap),
    Case("offsets-gap", _offsets_gap),
    Case("bytes-not-numel-x-itemsize", _byte_count),
    Case("unknown-dtype", _unknown_dtype),
    Case("index-missing-file", _index_missing_file),
    Case("index-absolute-path", _index_absolute),
    Case("index-dotdot", _index_dotdot),
    Case("index-symlink-escape", _index_symlink),
    Case("tensor-in-two-files", _tensor_in_two_files),
    Case("pickle-runs-code", _pickle_runs_code, base=""),
    Case("config-missing", _config_missing),
    Case("config-contradicts-tensors", _config_contradicts),
    Case("tensor-missing", _tensor_missing),
    Case("tensor-unexpected", _tensor_unexpected),
    Case("tensor-unexpected-no-strict", _tensor_unexpected_allowed, fault="", ok=True),
    Case("tp3-heads", _tp_heads, nproc=3),
    Case("tp2-kv-heads", _tp_kv_heads, base="kv3"),
    Case("tp2-intermediate", _tp_intermediate, base="inter129"),
    Case("tp2-fp8-block", _tp_block, base="block32"),
    Case("ep3-world4", _ep_world, base="mixtral", nproc=4, before_group=True),
    Case("ep3-experts4", _ep_experts, base="mixtral", nproc=3),
    Case("checksums-ok", _checksums_ok, fault="", ok=True),
    # Hashed on the bytes as the transfer reads them (integrity.py): refused once they are read, before the load ends.
    Case("checksum-mismatch", _checksum_mismatch, fault=""),
    Case("nonfinite", _nonfinite, fault=""),
    # checked while reading (sharded/reload.py), so this one does reach the transfer
    Case("sharded-save-tampered", _sharded_tampered, base="", fault="", after="checksums-ok", same_text=False),
    Case("fault-read-error", _fault_read_error, fault="read-error@rank0:read:3"),
    Case("fault-read-error-owners", _fault_read_error_owners, fault="read-error@rank1:read:2"),
    Case("fault-raise-nonreader", _fault_raise_nonreader, fault="raise@rank1:transfer:3", after="checksums-ok"),
    Case("fault-kill", _over_previous_save, fault="kill@rank1:transfer:3", after="checksums-ok"),
    Case("fault-kill-while-saving", _over_previous_save, fault="kill@rank1:save-sharded (write)",
         after="checksums-ok"),
    Case("fault-hang", _fault_hang, fault="hang@rank1:transfer:3"),
]
BY_ID = {c.id: c for c in CASES}


# ----------------------------------------------------------------------------------------------------
# Running jobs


@dataclass
class Outcome:
    rc: int | None
    seconds: float
    output: str
    args: list = field(default_factory=list)
    names: list = field(default_factory=list)
    leftovers: list = field(default_factory=list)
    before: dict = field(default_factory=dict)   # sharded save's file digests before the job
    after: dict = field(default_factory=dict)


def _digests(directory: Path) -> dict:
    if not directory.is_dir():
        return {}
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


def _processes_mentioning(text: str) -> list[str]:
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.pid != os.getpid() and any(text in part for part in (p.info["cmdline"] or [])):
                found.append(f"{p.pid}: {' '.join(p.info['cmdline'])[:200]}")
        except psutil.Error:
            pass
    return found


def _job_env(fault: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
    env.pop("DISTLOAD_FAULT", None)
    if fault:
        env["DISTLOAD_FAULT"] = fault
    return env


def _torchrun_case(case: Case, ws: Path, bases: dict) -> Outcome:
    try:
        outcome = _run_torchrun_case(case, ws, bases)
    except Exception as exc:  # a builder failed (e.g. the save it copies is missing): this case fails, not all
        import traceback

        outcome = Outcome(None, 0.0, f"building the case failed: {exc}\n{traceback.format_exc()}")
    (ws / "output.txt").write_text(f"rc={outcome.rc} {outcome.seconds:.1f}s\n{outcome.output}")
    return outcome


def _run_torchrun_case(case: Case, ws: Path, bases: dict) -> Outcome:
    ckpt = ws / "ckpt"
    if case.base:
        shutil.copytree(bases[case.base], ckpt)
    else:
        ckpt.mkdir()
    args, names = case.build(ckpt, ws)
    previous = Path(args[args.index("--save-sharded") + 1]) if "--save-sharded" in args else None
    before = _digests(previous) if previous else {}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(case.nproc),
           "-m", "distload", "load", *args, "--timeout", PG_TIMEOUT, "--no-progress"]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=KILL_AFTER_S,
                              env=_job_env(case.fault), cwd=ws)
        rc, output = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as exc:
        rc, output = None, (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
    seconds = time.monotonic() - start
    return Outcome(rc, seconds, output, args, names, _processes_mentioning(f"{ws}/"), before,
                   _digests(previous) if previous else {})


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """The base checkpoints the corpus starts from: tiny real models, saved by transformers."""
    from hf_models import save_checkpoint

    root = tmp_path_factory.mktemp("faults")
    out = {
        "llama": save_checkpoint("llama", root / "base-llama"),                       # 4 heads, 2 kv heads
        "kv3": save_checkpoint("llama", root / "base-kv3", hidden_size=48, num_attention_heads=6,
                               num_key_value_heads=3),
        "inter129": save_checkpoint("llama", root / "base-inter129", intermediate_size=129),
        "mixtral": save_checkpoint("mixtral", root / "base-mixtral"),                 # 4 experts
    }
    _block_fp8(out["llama"], root / "base-block32", 32)
    out["block32"] = root / "base-block32"
    return out


@pytest.fixture(scope="module")
def outcomes(bases):
    """Every torchrun case, run JOBS_AT_ONCE at a time; cases that need another's output wait for it."""
    root = Path(bases["llama"]).parent
    results, futures = {}, {}
    with ThreadPoolExecutor(JOBS_AT_ONCE) as pool:
        def submit(case):
            ws = root / case.id
            ws.mkdir()
            futures[case.id] = pool.submit(_torchrun_case, case, ws, bases)

        # Cases that others build on go first, then the hang (it lasts the whole --timeout), then the rest.
        needed = {c.after for c in CASES}
        for case in sorted(CASES, key=lambda c: (c.id not in needed, c.id != "fault-hang")):
            if not case.after:
                submit(case)
        for case in CASES:
            if case.after:
                futures[case.after].result()
                submit(case)
        for case_id, fut in futures.items():
            results[case_id] = fut.result()
    # The table for the record (shown with `pytest -s`): exit code and wall time of every job.
    print("\n".join(f"{c.id:32s} nproc={c.nproc} rc={results[c.id].rc} {results[c.id].seconds:6.1f}s" for c in CASES))
    return results


def _describe(o: Outcome) -> str:
    return f"rc={o.rc} in {o.seconds:.1f}s, args {o.args}\n{o.output[-6000:]}"


def _error_lines(output: str) -> dict[int, list[str]]:
    lines: dict[int, list[str]] = {}
    for rank, message in ERROR_LINE.findall(output):
        lines.setdefault(int(rank), []).append(message)
    return lines


# ----------------------------------------------------------------------------------------------------
# The table


REFUSALS = [c.id for c in CASES if not c.ok and not c.id.startswith("fault-")]


def _common(o: Outcome, case: Case) -> None:
    assert o.rc is not None, f"{case.id}: the job did not end within {KILL_AFTER_S}s\n{_describe(o)}"
    assert o.seconds < LIMIT_S, f"{case.id}: took {o.seconds:.1f}s\n{_describe(o)}"
    assert not o.leftovers, f"{case.id}: processes left behind: {o.leftovers}"


@pytest.mark.parametrize("case_id", REFUSALS)
def test_refused_on_every_rank(outcomes, case_id):
    """Non-zero exit, every rank the same message naming the file / tensor / rule, before any transfer."""
    case, o = BY_ID[case_id], outcomes[case_id]
    _common(o, case)
    assert o.rc != 0, _describe(o)
    assert "SIGKILL" not in o.output and "Signal 9" not in o.output, f"reached the transfer:\n{_describe(o)}"
    lines = _error_lines(o.output)
    messages = {m for ms in lines.values() for m in ms}
    assert len(messages) == 1 or not case.same_text, f"ranks disagree: {lines}\n{_describe(o)}"
    if case.before_group:  # no process group yet: torchrun may stop a rank before it prints
        assert lines, _describe(o)
    else:
        assert sorted(lines) == list(range(case.nproc)), f"not every rank reported: {lines}\n{_describe(o)}"
    for message in messages:
        for needle in o.names:
            assert needle in message, f"{case_id}: {needle!r} not in the message: {message}"


def test_pickle_never_ran(outcomes, bases):
    o = outcomes["pickle-runs-code"]
    marker = Path(bases["llama"]).parent / "pickle-runs-code" / "pickle-ran.marker"
    assert not marker.exists(), "the checkpoint's pickle executed code"
    # The control: the same file, loaded the unsafe way, does run its code (so the test proves something).
    torch.load(Path(o.args[0]) / "pytorch_model.bin", weights_only=False)
    assert marker.exists()


def test_no_strict_loads_and_names_the_unexpected(outcomes):
    o = outcomes["tensor-unexpected-no-strict"]
    _common(o, BY_ID["tensor-unexpected-no-strict"])
    assert o.rc == 0, _describe(o)
    assert "model.layers.0.mlp.surprise.weight" in o.output, _describe(o)


def test_checksums_and_finite_pass_on_a_good_checkpoint(outcomes):
    o = outcomes["checksums-ok"]
    _common(o, BY_ID["checksums-ok"])
    assert o.rc == 0, _describe(o)
    assert "distload: OK llama" in o.output, _describe(o)


def test_save_untouched_by_a_failed_job(outcomes):
    """Whatever killed the job, the earlier save at --save-sharded OUT is byte for byte what it was."""
    for case_id in ("fault-raise-nonreader", "fault-kill", "fault-kill-while-saving"):
        o = outcomes[case_id]
        assert o.before and o.after == o.before, f"{case_id}: {o.before} -> {o.after}"


@pytest.mark.parametrize("case_id", ["fault-read-error", "fault-read-error-owners"])
def test_fault_read_error(outcomes, case_id):
    """A reader's I/O error (rank 0, the one reader; or rank 1 reading its own pieces with --readers owners)
    ends both ranks, each naming the failing rank, the cause and the file."""
    o = outcomes[case_id]
    _common(o, BY_ID[case_id])
    assert o.rc != 0
    lines = _error_lines(o.output)
    assert sorted(lines) == [0, 1], _describe(o)
    for rank in (0, 1):
        assert all(n in lines[rank][0] for n in o.names), lines[rank]


def test_fault_raise_on_a_non_reader(outcomes):
    """The raising rank stops doing its part but keeps the protocol's shape: peers learn why in seconds."""
    o = outcomes["fault-raise-nonreader"]
    _common(o, BY_ID["fault-raise-nonreader"])
    assert o.rc != 0
    lines = _error_lines(o.output)
    assert 0 in lines and all(n in lines[0][0] for n in o.names), _describe(o)
    assert "transfer failed on 1 rank(s): rank 1: RuntimeError: injected fault" in lines[0][0]
    assert "[rank1]: RuntimeError: injected fault" in o.output, _describe(o)
    assert "lost a peer" not in o.output and "Timed out" not in o.output, f"waited for the timeout: {_describe(o)}"


def test_fault_kill_ends_the_job(outcomes):
    """A SIGKILLed rank: torchrun's agent ends the rest and names it; whoever printed names it too."""
    for case_id in ("fault-kill", "fault-kill-while-saving"):
        o = outcomes[case_id]
        _common(o, BY_ID[case_id])
        assert o.rc != 0
        assert re.search(r"rank\s+: 1 \(local_rank: 1\)\s+exitcode\s+: -9", o.output), _describe(o)
        for messages in _error_lines(o.output).values():
            assert "rank 1" in messages[0], _describe(o)


def test_fault_hang_ends_at_the_timeout(outcomes):
    """A rank that hangs (a stuck file system): the others give up at --timeout, naming it."""
    o = outcomes["fault-hang"]
    _common(o, BY_ID["fault-hang"])
    assert o.rc != 0
    lines = _error_lines(o.output)
    assert 0 in lines and "no word from rank 1" in lines[0][0], _describe(o)


# ----------------------------------------------------------------------------------------------------
# Faults under the Python API, in a job without torchrun's agent: nobody kills the survivors for us.


def _api_rank(rank: int, world: int, path: str, fault: str, out_dir: str) -> None:
    """One rank of a job that made its own process group (a file store: no port to race for)."""
    import datetime

    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      CUDA_VISIBLE_DEVICES="", DISTLOAD_FAULT=fault)
    import distload
    import torch.distributed.nn.functional  # noqa: F401  (before the group: see topology.init_process_group)

    code, message = 0, "ok"
    try:
        dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=int(PG_TIMEOUT)))
        distload.load(path, tp=world, progress=False)
    except distload.DistloadError as exc:
        code, message = 1, f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - the rank's own injected error: reported, then exit non-zero
        code, message = 2, f"{type(exc).__name__}: {exc}"
    Path(out_dir, f"rank{rank}.txt").write_text(message)
    os._exit(code)  # no interpreter teardown: a broken process group must not make exiting hang


def _api_job(path: str, world: int, fault: str, out_dir: Path) -> dict:
    import torch.multiprocessing as mp

    out_dir.mkdir()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_api_rank, args=(r, world, path, fault, str(out_dir))) for r in range(world)]
    start = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=max(1.0, KILL_AFTER_S - (time.monotonic() - start)))
    seconds = time.monotonic() - start
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    messages = {r: (out_dir / f"rank{r}.txt").read_text() for r in range(world) if (out_dir / f"rank{r}.txt").exists()}
    return {"exitcodes": [p.exitcode for p in procs], "seconds": seconds, "messages": messages}


API_FAULTS = [
    # (fault, the rank it hits, what every surviving rank's message must name)
    ("read-error@rank0:read:2", 0, ["Input/output error", "rank 0"]),
    ("raise@rank1:transfer:2", 1, ["rank 1", "RuntimeError: injected fault"]),
    ("kill@rank1:transfer:2", 1, ["no word from rank 1"]),
    # a rank failing between the transfer and the reconciliation's all-gather still takes part in it
    ("raise@rank1:local-record", 1, ["rank 1", "RuntimeError: injected fault"]),
]


def test_faults_under_the_python_api(bases, tmp_path):
    with ThreadPoolExecutor(len(API_FAULTS)) as pool:
        jobs = [pool.submit(_api_job, str(bases["llama"]), 2, fault, tmp_path / f"job{i}")
                for i, (fault, _, _) in enumerate(API_FAULTS)]
        results = [j.result() for j in jobs]
    for (fault, _, _), res in zip(API_FAULTS, results):
        print(f"python API {fault:32s} exitcodes={res['exitcodes']} {res['seconds']:6.1f}s")
    for (fault, failing, names), res in zip(API_FAULTS, results):
        where = f"{fault}: {res}"
        assert all(code is not None and code != 0 for code in res["exitcodes"]), where
        assert res["seconds"] < LIMIT_S, where
        if fault.startswith("kill"):
            assert res["exitcodes"][failing] == -9, where
        for rank, message in res["messages"].items():
            if rank != failing:
                assert message.startswith(("RankFailure", "CheckpointError")), where
                assert all(n in message for n in names), where
        assert set(res["messages"]) >= {r for r in range(2) if r != failing}, where


# ----------------------------------------------------------------------------------------------------
# Pure parts


def test_fault_spec_parsing():
    from distload.faults import parse_spec

    assert parse_spec("kill@rank1:save-sharded (write)") == ("kill", 1, "save-sharded (write)", 1)
    assert parse_spec("read-error@rank0:read:3") == ("read-error", 0, "read", 3)
    assert parse_spec("kill@transfer") == ("kill", None, "transfer", 1)
    with pytest.raises(ValueError, match="ACTION@"):
        parse_spec("explode@transfer")


def test_checksums_file_format(tmp_path):
    from distload.errors import CheckpointError
    from distload.checkpoint.integrity import files_for_reader, read_checksums

    digest = "ab" * 32
    (tmp_path / "checksums").write_text(f"{digest}  a.safetensors\n{digest.upper()} *./b.safetensors\n\n")
    assert read_checksums(str(tmp_path)) == {"a.safetensors": digest, "b.safetensors": digest}
    (tmp_path / "checksums").write_text("not a checksum line\n")
    with pytest.raises(CheckpointError, match=r"checksums:1: expected `sha256sum` output"):
        read_checksums(str(tmp_path))
    (tmp_path / "checksums").unlink()
    with pytest.raises(CheckpointError, match="sha256sum"):
        read_checksums(str(tmp_path))
    files = [f"f{i}" for i in range(5)]
    shares = [files_for_reader(files, (0, 2), r) for r in range(4)]
    assert shares == [["f0", "f2", "f4"], [], ["f1", "f3"], []]  # each file hashed once, by a reader
