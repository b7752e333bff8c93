"""distload.checkpoint: header parser, discovery, range reads, legacy files.

Every corpus file is generated in tmp_path: golden files by `safetensors.torch.save_file` / `torch.save`,
malformed and hostile ones by hand (8-byte little-endian header length + JSON + data).
"""

from __future__ import annotations

import errno
import json
import os
import sys
import pickle
import struct
from collections import namedtuple

import psutil
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from distload.checkpoint import (
    MAX_HEADER_BYTES,
    STRATEGIES,
    LegacyFile,
    RangeReader,
    Reader,
    ReaderWrapper,
    choose_strategy,
    discover,
    evict_from_page_cache,
    legacy_entries,
    load_legacy_file,
    parse_safetensors_header,
)
from distload.checkpoint.early_fetch import early_fetch_ranges, start_early_fetch
from distload.dtypes import TORCH_TO_SAFETENSORS
from distload.errors import CheckpointError, DistloadError


def golden_tensors(offset: int = 0) -> dict[str, torch.Tensor]:
    """Distinct values everywhere (arange + offset), so a misplaced byte shows where it came from."""
    return {
        "model.embed.weight": torch.arange(24, dtype=torch.float32).reshape(4, 6) + offset,
        "model.norm.weight": (torch.arange(6, dtype=torch.float32) + offset).to(torch.bfloat16),
        "model.half": (torch.arange(5, dtype=torch.float32) + offset).to(torch.float16),
        "model.ids": torch.arange(3, dtype=torch.int64) + offset,
        "model.mask": torch.tensor([True, False, True]),
        "model.fp8": torch.linspace(-2, 2, 8).to(torch.float8_e4m3fn),
        "model.empty": torch.zeros(0, 4),
        "model.scalar": torch.tensor(7.0 + offset),
    }


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def read_entry(reader: RangeReader, entry) -> bytes:
    buf = torch.empty(entry.nbytes, dtype=torch.uint8)
    assert reader.read_into(entry.file, entry.offset, buf) == entry.nbytes
    return buf.numpy().tobytes()


def handmade(path, header, data: bytes = b"", raw_header: bytes | None = None) -> str:
    body = raw_header if raw_header is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)
    return str(path)


# -- header parser: golden ---------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_golden_file_matches_safetensors(tmp_path, strategy):
    tensors = golden_tensors()
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    entries = parse_safetensors_header(tmp_path / "model.safetensors")

    assert set(entries) == set(tensors)
    offsets = [e.offset for e in entries.values()]
    assert offsets == sorted(offsets)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as st, RangeReader(str(tmp_path), strategy) as r:
        for name, entry in entries.items():
            assert entry.file == "model.safetensors"
            assert list(entry.shape) == st.get_slice(name).get_shape()
            assert entry.dtype == st.get_slice(name).get_dtype()
            assert entry.nbytes == entry.numel * tensors[name].element_size()
            assert read_entry(r, entry) == as_bytes(st.get_tensor(name)), name
        assert r.files_opened == {"model.safetensors"}
        assert r.bytes_read == sum(e.nbytes for e in entries.values())


def test_readers_share_one_protocol(tmp_path):
    """RangeReader and the wrappers over it (checksums, DCP) are Readers; a wrapper's bytes and counters are
    its inner reader's."""
    from distload.checkpoint.dcp import DcpReader
    from distload.sharded.reload import ChecksumReader

    tensors = golden_tensors()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    entry = next(iter(parse_safetensors_header(tmp_path / "model.safetensors").values()))
    with RangeReader(str(tmp_path)) as inner:
        wrapper = ReaderWrapper(inner)
        for reader in (inner, wrapper, ChecksumReader(inner, {})):
            assert isinstance(reader, Reader), type(reader).__name__
        assert issubclass(DcpReader, ReaderWrapper)
        assert read_entry(wrapper, entry) == read_entry(inner, entry)
        assert wrapper.bytes_read == inner.bytes_read == 2 * entry.nbytes
        assert wrapper.files_opened == {"model.safetensors"} and wrapper.strategy == "plain"


def test_display_name_and_empty_file(tmp_path):
    save_file({}, str(tmp_path / "empty.safetensors"))
    assert parse_safetensors_header(tmp_path / "empty.safetensors", display_name="sub/empty.safetensors") == {}


# -- header parser: malformed and hostile ------------------------------------------------------------


def f32(shape, begin, end):
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}


MALFORMED = {
    # name: (header, data, raw_header, expected message fragment)
    "bad_utf8": (None, b"", b"\xff\xfe{}", "not valid UTF-8"),
    "not_json": (None, b"", b"{not json", "not valid JSON"),
    "not_object": ([1, 2], b"", None, "must be a JSON object"),
    "duplicate_key": (None, bytes(8), b'{"a":' + json.dumps(f32([1], 0, 4)).encode() + b',"a":'
                      + json.dumps(f32([1], 4, 8)).encode() + b"}", "duplicate key 'a'"),
    "huge_int_literal": (None, b"", b'{"w": {"dtype": "F32", "shape": [' + b"9" * 10_000 + b'], "data_offsets": [0, 4]}}',
                         "not valid JSON"),
    "deep_nesting": (None, b"", b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    "metadata_not_str": ({"__metadata__": {"k": 1}}, b"", None, "__metadata__"),
    "metadata_list": ({"__metadata__": ["x"]}, b"", None, "__metadata__"),
    "entry_not_object": ({"w": [1]}, b"", None, "'w': entry must have exactly keys"),
    "missing_key": ({"w": {"dtype": "F32", "shape": [1]}}, bytes(4), None, "'w': entry must have exactly keys"),
    "extra_key": ({"w": {**f32([1], 0, 4), "x": 1}}, bytes(4), None, "'w': entry must have exactly keys"),
    "bad_dtype": ({"w": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, bytes(8), None, "dtype 'C64'"),
    "dtype_not_str": ({"w": {"dtype": 5, "shape": [1], "data_offsets": [0, 8]}}, bytes(8), None, "dtype 5"),
    "negative_dim": ({"w": f32([-1], 0, 4)}, bytes(4), None, "'w': shape"),
    "float_dim": ({"w": f32([1.0], 0, 4)}, bytes(4), None, "'w': shape"),
    "bool_dim": ({"w": f32([True], 0, 4)}, bytes(4), None, "'w': shape"),
    "shape_not_list": ({"w": f32(4, 0, 16)}, bytes(16), None, "'w': shape"),
    "negative_offset": ({"w": f32([1], -4, 0)}, b"", None, "'w': data_offsets"),
    "three_offsets": ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}}, bytes(8), None, "data_offsets"),
    "reversed_offsets": ({"w": f32([0], 4, 0)}, bytes(4), None, "end before they begin"),
    "byte_count": ({"w": f32([2], 0, 4)}, bytes(4), None, "needs 8"),
    "past_end": ({"w": f32([4], 0, 16)}, bytes(8), None, "run past the 8-byte data section"),
    "overlap": ({"a": f32([2], 0, 8), "b": f32([2], 4, 12)}, bytes(12), None, "'b' (data_offsets begin 4) overlaps 'a'"),
    "gap": ({"a": f32([1], 0, 4), "b": f32([1], 8, 12)}, bytes(12), None, "4-byte gap after 'a'"),
    "not_from_zero": ({"a": f32([1], 4, 8)}, bytes(8), None, "gap after the start"),
    "trailing_junk": ({"a": f32([1], 0, 4)}, bytes(6), None, "2 trailing bytes"),
    "junk_without_tensors": ({}, b"xx", None, "2 trailing bytes"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_header_is_rejected(tmp_path, case):
    header, data, raw, fragment = MALFORMED[case]
    path = handmade(tmp_path / f"{case}.safetensors", header, data, raw)
    with pytest.raises(CheckpointError) as err:
        parse_safetensors_header(path)
    assert f"{case}.safetensors" in str(err.value)
    assert fragment in str(err.value)


@pytest.mark.parametrize(
    "content, fragment",
    [
        (b"", "shorter than the 8-byte header length"),
        (b"\x02\x00\x00", "shorter than the 8-byte header length"),
        (struct.pack("<Q", 1000) + b"{}", "runs past the end"),
        (struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}", "exceeds the"),
        (struct.pack("<Q", 2**64 - 1), "exceeds the"),
    ],
    ids=["empty", "short_prefix", "header_past_end", "header_over_cap", "header_u64_max"],
)
def test_truncated_or_absurd_length(tmp_path, content, fragment):
    (tmp_path / "t.safetensors").write_bytes(content)
    with pytest.raises(CheckpointError, match=fragment):
        parse_safetensors_header(tmp_path / "t.safetensors")


def test_truncated_golden_file(tmp_path):
    save_file(golden_tensors(), str(tmp_path / "model.safetensors"))
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-3])
    with pytest.raises(CheckpointError, match="model.safetensors: tensor .* run past"):
        parse_safetensors_header(tmp_path / "model.safetensors")


def test_not_a_regular_file(tmp_path):
    os.mkfifo(tmp_path / "fifo.safetensors")  # opening it would block forever
    with pytest.raises(CheckpointError, match="not a regular file"):
        parse_safetensors_header(tmp_path / "fifo.safetensors")


# -- discovery ----------------------------------------------------------------------------------------


def write_sharded(root, with_index: bool = True) -> dict[str, torch.Tensor]:
    """Two shards (+ index): the golden tensors split in two files."""
    tensors = golden_tensors()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:4], "model-00002-of-00002.safetensors": names[4:]}
    for rel, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(root / rel))
    if with_index:
        write_index(root, {n: rel for rel, ns in shards.items() for n in ns})
    (root / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    return tensors


def write_index(root, weight_map, name="model.safetensors.index.json"):
    (root / name).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))


def test_discover_sharded_with_index(tmp_path):
    tensors = write_sharded(tmp_path)
    index = discover(tmp_path)
    assert index.format == "safetensors"
    assert index.root == str(tmp_path)
    assert index.files == ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    assert index.ignored_files == ()
    assert index.config == {"architectures": ["LlamaForCausalLM"]}
    assert set(index.tensors) == set(tensors)
    keys = [(e.file, e.offset) for e in index.tensors.values()]
    assert keys == sorted(keys)
    assert index.total_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    with RangeReader(index.root) as r:
        for name, entry in index.tensors.items():
            assert read_entry(r, entry) == as_bytes(tensors[name]), name
        assert r.files_opened == set(index.files)


def test_discover_without_index_uses_all_safetensors(tmp_path):
    write_sharded(tmp_path, with_index=False)
    torch.save({"x": torch.ones(1)}, tmp_path / "pytorch_model.bin")
    index = discover(tmp_path)
    assert len(index.files) == 2
    assert index.ignored_files == ("pytorch_model.bin",)
    assert index.config["architectures"] == ["LlamaForCausalLM"]


def test_stray_consolidated_file_is_ignored_and_logged(tmp_path, caplog):
    write_sharded(tmp_path)
    save_file(golden_tensors(), str(tmp_path / "consolidated.safetensors"))  # same names: would clash
    with caplog.at_level("WARNING", logger="distload"):
        index = discover(tmp_path)
    assert index.ignored_files == ("consolidated.safetensors",)
    assert "consolidated.safetensors" not in index.files
    assert "consolidated.safetensors" in caplog.text


def test_same_tensor_in_two_files_without_index(tmp_path):
    write_sharded(tmp_path, with_index=False)
    save_file({"model.ids": torch.zeros(3, dtype=torch.int64)}, str(tmp_path / "extra.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model.ids' is stored in two files, 'extra.safetensors' and 'model-0000"):
        discover(tmp_path)


def test_same_tensor_in_two_files_listed_in_index(tmp_path):
    write_sharded(tmp_path)
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    save_file({"extra": torch.zeros(1), "model.ids": torch.zeros(3, dtype=torch.int64)}, str(tmp_path / "extra.safetensors"))
    write_index(tmp_path, {**weight_map, "extra": "extra.safetensors"})
    with pytest.raises(CheckpointError, match=r"'model.ids' is stored in two files, .*'extra.safetensors'"):
        discover(tmp_path)


def test_index_mapping_a_tensor_to_two_files(tmp_path):
    write_sharded(tmp_path)
    body = '{"weight_map": {"model.ids": "model-00001-of-00002.safetensors", "model.ids": "other.safetensors"}}'
    (tmp_path / "model.safetensors.index.json").write_text(body)
    with pytest.raises(CheckpointError, match="'model.ids' is mapped to two files"):
        discover(tmp_path)


def test_index_naming_missing_file(tmp_path):
    write_sharded(tmp_path)
    os.remove(tmp_path / "model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointError, match="model.safetensors.index.json names 'model-00002-of-00002.safetensors'.*missing"):
        discover(tmp_path)


@pytest.mark.parametrize(
    "bad_path, fragment",
    [("/etc/passwd", "absolute"), ("../outside.safetensors", r"'\.\.'"), ("sub/../../outside.safetensors", r"'\.\.'")],
)
def test_index_paths_must_stay_inside(tmp_path, bad_path, fragment):
    root = tmp_path / "ckpt"
    root.mkdir()
    save_file({"w": torch.ones(2)}, str(tmp_path / "outside.safetensors"))
    write_index(root, {"w": bad_path})
    with pytest.raises(CheckpointError, match=f"model.safetensors.index.json entry .*{fragment}") as err:
        discover(root)
    assert bad_path in str(err.value)


def test_index_symlink_escape(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    save_file({"w": torch.ones(2)}, str(tmp_path / "outside.safetensors"))
    os.symlink(tmp_path / "outside.safetensors", root / "model.safetensors")
    write_index(root, {"w": "model.safetensors"})
    with pytest.raises(CheckpointError, match="index.json entry 'model.safetensors' is a symlink resolving to .*outside"):
        discover(root)
    os.remove(root / "model.safetensors.index.json")  # and without an index, the same rule
    with pytest.raises(CheckpointError, match="symlink resolving to"):
        discover(root)


def test_symlink_inside_root_is_fine(tmp_path):
    (tmp_path / "real").mkdir()
    save_file({"w": torch.ones(2)}, str(tmp_path / "real" / "w.safetensors"))
    os.symlink("real/w.safetensors", tmp_path / "model.safetensors")
    assert set(discover(tmp_path).tensors) == {"w"}


def test_hugging_face_cache_layout_is_allowed(tmp_path):
    # snapshots/<rev>/<file> -> ../../blobs/<sha>: how huggingface_hub stores every downloaded file.
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "abc123"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    save_file({"w": torch.ones(2)}, str(blobs / "f00d"))
    os.symlink("../../blobs/f00d", snapshot / "model.safetensors")
    index = discover(snapshot)
    with RangeReader(index.root) as r:
        assert read_entry(r, index.tensors["w"]) == as_bytes(torch.ones(2))


def test_index_and_files_disagree(tmp_path):
    write_sharded(tmp_path)
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    wrong = {**weight_map, "model.half": "model-00002-of-00002.safetensors"}  # it lives in shard 1
    write_index(tmp_path, wrong)
    with pytest.raises(CheckpointError, match="puts tensor 'model.half' in 'model-00002-of-00002.safetensors'"):
        discover(tmp_path)
    del weight_map["model.half"]
    write_index(tmp_path, weight_map)
    with pytest.raises(CheckpointError, match="file 'model-00001-of-00002.safetensors' holds tensor 'model.half'"):
        discover(tmp_path)


def test_invalid_index_and_config(tmp_path):
    write_sharded(tmp_path)
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match="config.json is not valid JSON"):
        discover(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": []}')
    with pytest.raises(CheckpointError, match="non-empty 'weight_map'"):
        discover(tmp_path)


def test_empty_or_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        discover(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        discover(tmp_path / "nope")


# -- reader -------------------------------------------------------------------------------------------


def test_reader_buffers_and_short_file(tmp_path):
    save_file({"w": torch.arange(1000, dtype=torch.float32)}, str(tmp_path / "model.safetensors"))
    entry = parse_safetensors_header(tmp_path / "model.safetensors")["w"]
    expected = as_bytes(torch.arange(1000, dtype=torch.float32))
    with RangeReader(str(tmp_path)) as r:
        ba = bytearray(entry.nbytes)
        assert r.read_into("model.safetensors", entry.offset, memoryview(ba)) == entry.nbytes
        assert bytes(ba) == expected
        part = torch.empty(10, 4, dtype=torch.uint8)  # any contiguous uint8 shape; a slice of the middle
        r.read_into("model.safetensors", entry.offset + 400, part)
        assert part.numpy().tobytes() == expected[400:440]
        with pytest.raises(CheckpointError, match=r"'model.safetensors' ended after 8 of the 16 bytes requested at offset"):
            r.read_into("model.safetensors", entry.offset + entry.nbytes - 8, bytearray(16))
        with pytest.raises(TypeError):
            r.read_into("model.safetensors", entry.offset, torch.empty(4, dtype=torch.float32))
        assert r.files_opened == {"model.safetensors"}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_reader_unaligned_ranges_across_bounce_buffer(tmp_path, strategy):
    data = os.urandom(9 * 1024 * 1024 + 123)  # larger than the O_DIRECT bounce buffer, odd length
    (tmp_path / "blob.safetensors").write_bytes(data)
    with RangeReader(str(tmp_path), strategy) as r:
        for offset, length in [(0, 10), (4093, 5000), (1, len(data) - 1), (len(data) - 7, 7)]:
            buf = bytearray(length)
            r.prefetch("blob.safetensors", offset, length)
            r.read_into("blob.safetensors", offset, buf)
            assert bytes(buf) == data[offset : offset + length], (offset, length)
        with pytest.raises(CheckpointError, match="ended after"):
            r.read_into("blob.safetensors", len(data) - 3, bytearray(5))


def test_reader_refuses_escaping_paths_and_unknown_strategy(tmp_path):
    with RangeReader(str(tmp_path)) as r, pytest.raises(CheckpointError, match=r"'\.\.'"):
        r.read_into("../x.safetensors", 0, bytearray(1))
    with pytest.raises(Exception, match="unknown read strategy"):
        RangeReader(str(tmp_path), "fastest")


def test_odirect_falls_back_where_refused(tmp_path, monkeypatch, caplog):
    data = os.urandom(10_000)
    (tmp_path / "a.safetensors").write_bytes(data)
    (tmp_path / "b.safetensors").write_bytes(data)
    real_open, real_preadv = os.open, os.preadv
    refuse_open_of = str(tmp_path / "a.safetensors")

    def open_refusing_direct(path, flags, *args):
        if flags & os.O_DIRECT and os.fspath(path) == refuse_open_of:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    refused_reads = []

    def preadv_refusing_once(fd, buffers, offset):
        if not refused_reads:  # b.safetensors: the open succeeds, the first read is refused
            refused_reads.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "open", open_refusing_direct)
    with caplog.at_level("WARNING", logger="distload"), RangeReader(str(tmp_path), "odirect") as r:
        buf = bytearray(100)
        r.read_into("a.safetensors", 5, buf)
        assert bytes(buf) == data[5:105] and "refuses O_DIRECT" in caplog.text
        monkeypatch.setattr(os, "preadv", preadv_refusing_once)
        r.read_into("b.safetensors", 4097, buf)
        assert bytes(buf) == data[4097:4197] and "read of b.safetensors refused" in caplog.text
        assert refused_reads


FakePartition = namedtuple("FakePartition", "device mountpoint fstype opts")


def test_choose_strategy(tmp_path, monkeypatch):
    strategy, reason = choose_strategy(tmp_path, ranks_on_node=4)
    assert strategy in ("plain", "prefetch") and str(tmp_path.resolve()) in reason

    parts = [FakePartition("/dev/vda", "/", "ext4", "rw"), FakePartition("srv:/x", str(tmp_path.resolve()), "nfs4", "rw")]
    monkeypatch.setattr(psutil, "disk_partitions", lambda all=False: parts)
    assert choose_strategy(tmp_path, checkpoint_bytes=1)[0] == "prefetch"
    strategy, reason = choose_strategy(tmp_path, checkpoint_bytes=psutil.virtual_memory().total * 2)
    assert strategy == "threaded" and "nfs4" in reason  # too big to prefetch: concurrent preads instead

    parts[1] = FakePartition("/dev/vdb", str(tmp_path.resolve()), "xfs", "rw")
    strategy, reason = choose_strategy(tmp_path, checkpoint_bytes=1, ranks_on_node=4)
    assert strategy == "plain" and "xfs" in reason and "local" in reason
    # a lone reader on its node: uncached pages as concurrent preads, cached ones inline
    strategy, reason = choose_strategy(tmp_path, checkpoint_bytes=1, ranks_on_node=1)
    assert strategy == "threaded-cold" and "one rank of this node reads" in reason

    # params on a GPU: threaded reads when each rank of the node has 4 CPUs, plain reads otherwise
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    strategy, reason = choose_strategy(tmp_path, checkpoint_bytes=1, device="cuda:0", ranks_on_node=1)
    assert strategy == "threaded" and "cuda:0" in reason and "16 CPUs" in reason
    assert choose_strategy(tmp_path, checkpoint_bytes=1, device="cuda:0", ranks_on_node=4)[0] == "threaded"
    assert choose_strategy(tmp_path, checkpoint_bytes=1, device="cuda:0", ranks_on_node=8)[0] == "plain"
    assert choose_strategy(tmp_path, checkpoint_bytes=1, device="cpu", ranks_on_node=2)[0] == "plain"
    # 8 GPUs and 16 CPUs: 2 per rank, too few for threads copying cached pages; the node's one reader gets
    # threads for what is not cached (the other ranks receive over NCCL)
    assert choose_strategy(tmp_path, checkpoint_bytes=1, device="cuda:0", ranks_on_node=8,
                           reading_on_node=1)[0] == "threaded-cold"
    assert choose_strategy(tmp_path, checkpoint_bytes=1, device="cpu", ranks_on_node=4,
                           reading_on_node=4)[0] == "plain"


def test_evict_from_page_cache(tmp_path):
    (tmp_path / "f").write_bytes(b"x" * 4096)
    evict_from_page_cache(tmp_path / "f")
    assert (tmp_path / "f").read_bytes() == b"x" * 4096


# -- legacy .bin / .pt --------------------------------------------------------------------------------


def test_bin_round_trip(tmp_path):
    tensors = golden_tensors()
    tensors["transposed"] = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()  # not contiguous
    torch.save(tensors, tmp_path / "pytorch_model.bin")
    torch.save({"x": 1}, tmp_path / "training_args.bin")  # trainer artefact: ignored, never loaded
    index = discover(tmp_path)
    assert index.format == "torch"
    assert index.files == ("pytorch_model.bin",)
    assert index.ignored_files == ("training_args.bin",)
    entries = list(index.tensors.values())
    assert [e.name for e in entries] == sorted(tensors)
    assert [e.offset for e in entries] == [sum(e.nbytes for e in entries[:i]) for i in range(len(entries))]
    for name, entry in index.tensors.items():
        assert entry.dtype == TORCH_TO_SAFETENSORS[tensors[name].dtype]
        assert entry.shape == tuple(tensors[name].shape)
    with RangeReader(index.root) as r:
        for name, entry in index.tensors.items():
            assert read_entry(r, entry) == as_bytes(tensors[name]), name
        # A range spanning several tensors is served like a safetensors data section.
        whole = bytearray(index.total_bytes)
        r.read_into("pytorch_model.bin", 0, whole)
        assert bytes(whole) == b"".join(as_bytes(tensors[n]) for n in sorted(tensors))
        with pytest.raises(CheckpointError, match="runs past the end"):
            r.read_into("pytorch_model.bin", index.total_bytes - 1, bytearray(2))
        assert r.files_opened == {"pytorch_model.bin"}


def test_legacy_sharded_index_and_pt(tmp_path):
    torch.save({"a": torch.ones(2)}, tmp_path / "pytorch_model-00001-of-00002.bin")
    torch.save({"b": torch.zeros(3)}, tmp_path / "pytorch_model-00002-of-00002.bin")
    weight_map = {"a": "pytorch_model-00001-of-00002.bin", "b": "pytorch_model-00002-of-00002.bin"}
    write_index(tmp_path, weight_map, name="pytorch_model.bin.index.json")
    assert {n: e.file for n, e in discover(tmp_path).tensors.items()} == weight_map

    pt = tmp_path / "pt"
    pt.mkdir()
    torch.save({"w": torch.ones(2, 2, dtype=torch.float16)}, pt / "model.pt")
    assert legacy_entries(pt, "model.pt")["w"].dtype == "F16"
    assert LegacyFile(pt / "model.pt", "model.pt").size == 8


def test_legacy_old_serialization_format(tmp_path):
    tensors = {"w": torch.arange(4, dtype=torch.int32)}
    torch.save(tensors, tmp_path / "old.bin", _use_new_zipfile_serialization=False)  # not mmap-able
    assert torch.equal(load_legacy_file(tmp_path / "old.bin")["w"], tensors["w"])


def test_legacy_rejects_non_tensors_and_unsupported_dtypes(tmp_path):
    torch.save({"step": 3, "w": torch.ones(1)}, tmp_path / "a.bin")
    with pytest.raises(CheckpointError, match="a.bin: entry 'step' is a int, not a tensor"):
        load_legacy_file(tmp_path / "a.bin")
    torch.save({"z": torch.ones(2, dtype=torch.complex64)}, tmp_path / "b.bin")
    with pytest.raises(CheckpointError, match="'z' has dtype torch.complex64"):
        load_legacy_file(tmp_path / "b.bin")
    torch.save([torch.ones(1)], tmp_path / "c.bin")
    with pytest.raises(CheckpointError, match="expected a state dict"):
        load_legacy_file(tmp_path / "c.bin")
    (tmp_path / "d.bin").write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(CheckpointError, match="d.bin: cannot load"):
        load_legacy_file(tmp_path / "d.bin")


class _WritesMarker:
    """Unpickling this would create a file: proof that code ran."""

    def __init__(self, action, marker):
        self.action, self.marker = action, str(marker)

    def __reduce__(self):
        if self.action == "system":
            return (os.system, (f"touch {self.marker}",))
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("action", ["system", "open"])
@pytest.mark.parametrize("container", ["torch.save", "raw pickle"])
def test_malicious_pickle_is_refused_without_running(tmp_path, action, container):
    marker = tmp_path / "pwned"
    payload = {"w": torch.ones(1), "evil": _WritesMarker(action, marker)}
    if container == "torch.save":
        torch.save(payload, tmp_path / "pytorch_model.bin")
    else:
        with open(tmp_path / "pytorch_model.bin", "wb") as f:
            pickle.dump(payload, f, protocol=2)
    with pytest.raises(CheckpointError, match="pytorch_model.bin.*refus.*execute code.*safetensors") as err:
        discover(tmp_path)
    assert not marker.exists(), "unpickling ran attacker code"
    assert "weights_only=False will" not in str(err.value)  # never relay torch's advice to disable the guard


def _cached_pages(path) -> list[bool]:
    """Which pages of a file are in the page cache (mincore on an untouched map; reading would fetch them)."""
    import ctypes
    import mmap

    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    with open(path, "rb") as fh:
        region = mmap.mmap(fh.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    anchor = ctypes.c_char.from_buffer(region)
    try:
        vec = (ctypes.c_ubyte * pages)()
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec):
            raise OSError(ctypes.get_errno(), "mincore")
        return [bool(v & 1) for v in vec]
    finally:
        del anchor
        region.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore, posix_fadvise: Linux")
def test_exact_reader_fetches_only_what_it_reads(tmp_path):
    """A reader that skips the rows another node reads (exact=True) must not pull them from storage by
    read-ahead: each node would then read most of the checkpoint."""
    import time

    path = tmp_path / "f"
    with open(path, "wb") as fh:
        fh.write(os.urandom(1 << 20) * 32)
        fh.flush()
        os.fsync(fh.fileno())
    read, page = 4 << 20, 4096
    for exact in (False, True):
        evict_from_page_cache(path)
        if any(_cached_pages(path)):
            pytest.skip("this file system keeps the file cached (tmpfs?): page-cache state cannot be observed")
        with RangeReader(str(tmp_path), exact=exact) as reader:
            reader.read_into("f", 0, torch.empty(read, dtype=torch.uint8))
            time.sleep(0.3)  # let read-ahead I/O in flight land
        cached = _cached_pages(path)
        # What was read is cached (most of it: CI once saw a few of those pages already gone again).
        assert sum(cached[:read // page]) >= 0.9 * (read // page)
        if not exact and not any(cached[read // page:]):
            pytest.skip("no read-ahead observed here: nothing for exact reads to avoid")
        if exact:
            assert not any(cached[read // page:]), f"an exact reader read ahead {sum(cached[read // page:])} pages"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore, posix_fadvise: Linux")
def test_exact_reader_prefetches_exactly_what_it_is_told(tmp_path):
    """With no kernel read-ahead, an exact reader relies on the transfer naming its next ranges: prefetch()
    brings exactly those pages in (a range longer than one WILLNEED fetches included); a plain reader
    leaves prefetching to the kernel."""
    import time

    path = tmp_path / "f"
    with open(path, "wb") as fh:
        fh.write(os.urandom(1 << 20) * 32)
        fh.flush()
        os.fsync(fh.fileno())
    page, lo, n = 4096, 3 << 20, 20 << 20
    for exact in (False, True):
        evict_from_page_cache(path)
        if any(_cached_pages(path)):
            pytest.skip("this file system keeps the file cached (tmpfs?): page-cache state cannot be observed")
        with RangeReader(str(tmp_path), exact=exact) as reader:
            reader.prefetch("f", lo, n)
            time.sleep(0.3)  # WILLNEED starts the reads; let them land
        cached = _cached_pages(path)
        if exact:  # one unsplit WILLNEED brings in 8 MiB of the 20 here (40%)
            assert sum(cached[lo // page:(lo + n) // page]) >= 0.9 * (n // page), "the range did not come in"
            assert not any(cached[:lo // page]) and not any(cached[(lo + n) // page:]), "more than the range"
        else:
            assert not any(cached)


@pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="preadv2 RWF_NOWAIT: Linux")
def test_threaded_cold_copies_cached_pages_inline_and_reads_the_rest_in_threads(tmp_path):
    import time

    path = tmp_path / "f"
    data = os.urandom(1 << 20) * 24
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    out = torch.empty(len(data), dtype=torch.uint8)
    for _ in range(3):  # under memory pressure a page may leave the cache before the read: try again
        path.read_bytes()  # every page cached: one inline copy, no thread started
        with RangeReader(str(tmp_path), strategy="threaded-cold") as reader:
            reader.read_into("f", 0, out)
            inline = reader._pool is None
        if inline:
            break
    assert bytes(out.numpy()) == data and inline

    def cache_only_the_head(head: int) -> None:  # no read-ahead on this descriptor
        evict_from_page_cache(path)
        if any(_cached_pages(path)):
            pytest.skip("this file system keeps the file cached (tmpfs?): page-cache state cannot be observed")
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        os.pread(fd, head, 0)
        os.close(fd)

    head = 6 << 20
    for _ in range(3):  # the kernel may still read ahead past the head on a busy machine: try again
        cache_only_the_head(head)
        with RangeReader(str(tmp_path), strategy="threaded-cold") as reader:
            probe = memoryview(bytearray(len(data)))
            cached = reader._read_cached("f", reader.fd_of("f"), 0, probe)
        if cached < len(data):
            break
    assert 0.9 * head <= cached < len(data) and bytes(probe[:cached]) == data[:cached]
    for _ in range(3):  # the kernel may read ahead past the head on a busy machine (then all is cached): again
        time.sleep(0.3)  # a miss under RWF_NOWAIT may still start read-ahead: let it land before evicting again
        cache_only_the_head(head)
        with RangeReader(str(tmp_path), strategy="threaded-cold") as reader:
            out.zero_()
            reader.read_into("f", 0, out)  # the cached head inline, the rest from storage in threads
            threaded = reader._pool is not None
        assert bytes(out.numpy()) == data
        if threaded:
            break
    assert threaded
    with RangeReader(str(tmp_path), strategy="threaded-cold") as reader:
        reader._nowait = False  # a file system that refuses RWF_NOWAIT: every byte through the threads
        out.zero_()
        reader.read_into("f", 3, out[:len(data) - 3])
        assert bytes(out[:len(data) - 3].numpy()) == data[3:]


Entry = namedtuple("Entry", "name file offset nbytes")


def test_early_fetch_ranges_follow_a_tp_split_of_the_first_tensors():
    """Each stream takes the front of its part of each tensor, in file order, until its share of the budget
    is spent; small tensors go whole to one stream; the streams' heads are asked for first."""
    mib = 1 << 20
    tensors = [Entry("b", "2.st", 100, 8 * mib), Entry("small", "1.st", 50, 1000),
               Entry("a", "1.st", 2000, 16 * mib), Entry("empty", "1.st", 2000, 0), Entry("stray", "x.st", 0, mib)]
    ranges = early_fetch_ranges(tensors, ("1.st", "2.st"), streams=4, budget=24 * mib)
    per_stream = 6 * mib
    # file 1 first: the small tensor whole (stream 0), then `a` in four 4 MiB parts; then the front of each
    # 2 MiB part of `b`, as much as each stream has left of its 6 MiB (stream 0: less the small tensor)
    assert sorted(ranges) == [("1.st", 50, 1000), ("1.st", 2000, 4 * mib), ("1.st", 2000 + 4 * mib, 4 * mib),
                              ("1.st", 2000 + 8 * mib, 4 * mib), ("1.st", 2000 + 12 * mib, 4 * mib),
                              ("2.st", 100, 2 * mib - 1000), ("2.st", 100 + 2 * mib, 2 * mib),
                              ("2.st", 100 + 4 * mib, 2 * mib), ("2.st", 100 + 6 * mib, 2 * mib)]
    assert sum(n for _, _, n in ranges) == 4 * per_stream
    assert not any(f == "x.st" for f, _, _ in ranges), "a file the index does not list"
    # a budget larger than the checkpoint asks for every byte once; none for a budget of 0
    whole = early_fetch_ranges(tensors, ("1.st", "2.st"), streams=4, budget=1 << 40)
    assert sum(n for _, _, n in whole) == 24 * mib + 1000
    assert early_fetch_ranges(tensors, ("1.st", "2.st"), streams=4, budget=0) == []
    # streams interleave: every stream's first range comes before any stream's second
    heads = early_fetch_ranges([Entry("a", "1.st", 0, 64 * mib), Entry("b", "1.st", 64 * mib, 64 * mib)],
                               ("1.st",), streams=2, budget=128 * mib)
    assert heads == [("1.st", 0, 32 * mib), ("1.st", 32 * mib, 32 * mib), ("1.st", 64 * mib, 32 * mib),
                     ("1.st", 96 * mib, 32 * mib)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore, posix_fadvise: Linux")
def test_early_fetch_brings_in_exactly_the_start_of_the_checkpoint(tmp_path, monkeypatch):
    """Started on an evicted checkpoint, the fetch brings the ranges it names into the page cache (the ranks
    then copy them without waiting on storage) and nothing after them."""
    import time

    tensors = {f"t{i}": torch.full((4, 1 << 18), i, dtype=torch.float32) for i in range(6)}  # 4 MiB each
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    path = tmp_path / "model.safetensors"
    with open(path, "rb+") as fh:
        os.fsync(fh.fileno())
    index = discover(tmp_path)
    evict_from_page_cache(path)
    if any(_cached_pages(path)):
        pytest.skip("this file system keeps the file cached (tmpfs?): page-cache state cannot be observed")
    monkeypatch.setenv("DISTLOAD_EARLY_FETCH_MIB", "8")
    fetch = start_early_fetch(index, streams=2)
    assert fetch.close() == 8 << 20
    time.sleep(0.3)  # WILLNEED starts the reads; let them land
    cached, page = _cached_pages(path), 4096
    first = sorted(index.tensors.values(), key=lambda e: e.offset)[:2]  # 4 MiB each: 8 MiB, two streams
    lo, hi = first[0].offset // page, -(-(first[1].offset + first[1].nbytes) // page)
    assert sum(cached[lo:hi]) >= 0.9 * (hi - lo), "the start of the checkpoint did not come in"
    assert not any(cached[hi + 1:]), f"{sum(cached[hi + 1:])} pages after the fetched ranges came in too"
    monkeypatch.setenv("DISTLOAD_EARLY_FETCH_MIB", "0")
    assert start_early_fetch(index, streams=2) is None
    monkeypatch.setenv("DISTLOAD_EARLY_FETCH_MIB", "lots")
    with pytest.raises(DistloadError, match="DISTLOAD_EARLY_FETCH_MIB='lots'.*0 turns"):
        start_early_fetch(index, streams=2)
