"""Object storage's pure parts (checkpoint/s3/): URLs, how ranges become GETs, the bandwidth cap on a given clock, the
node cache on a temporary folder, the options of one kind of checkpoint, and the header parser on fetched bytes.
The load itself against a real S3 server: tests/ranks/test_object_store_ranks.py and tests/jobs/test_object_store_jobs.py."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from distload.checkpoint.header import entries_from_header, header_length, parse_safetensors_header
from distload.checkpoint.s3.cache import NodeCache, span_name
from distload.checkpoint.s3.client import redact
from distload.checkpoint.s3.fetch import MIN_PIECE_BYTES, PIECE_BYTES, joined, pieces, slices
from distload.checkpoint.s3.pace import Pacer, reader_share
from distload.checkpoint.s3.url import ObjectUrl, ObjectVersion, is_object_url
from distload.errors import CheckpointError, OptionError
from distload.options import LoadOptions
from distload.validate import validate_load_options


def test_urls_name_bucket_prefix_and_keys():
    url = ObjectUrl.parse("s3://models/llama/7b/")
    assert (url.bucket, url.prefix, str(url)) == ("models", "llama/7b", "s3://models/llama/7b")
    assert url.key("config.json") == "llama/7b/config.json" and url.name_of("llama/7b/a.safetensors") == "a.safetensors"
    assert url.of("a.safetensors") == "s3://models/llama/7b/a.safetensors"
    bare = ObjectUrl.parse("s3://models")
    assert bare.key("config.json") == "config.json" and str(bare) == "s3://models"
    assert is_object_url("s3://x/y") and not is_object_url("/data/s3://x")


@pytest.mark.parametrize("bad", ["s3://", "s3:///prefix", "s3://b/a/../c", "s3://b/./c", "/local/dir"])
def test_bad_urls_are_refused_by_name(bad):
    with pytest.raises(CheckpointError, match="s3://"):
        ObjectUrl.parse(bad)


@pytest.mark.parametrize("start,end", [(0, 1), (5, 5 + MIN_PIECE_BYTES // 2), (3, 3 + 5 * PIECE_BYTES + 7),
                                       (100, 100 + 3 * MIN_PIECE_BYTES)])
def test_pieces_cover_a_range_exactly_within_their_bounds(start, end):
    got = pieces(start, end, concurrency=8)
    assert got[0][0] == start and got[-1][1] == end
    assert all(a[1] == b[0] for a, b in zip(got, got[1:]))
    assert all(b - a <= PIECE_BYTES for a, b in got)
    assert all(b - a >= MIN_PIECE_BYTES for a, b in got[:-1])
    assert len(got) <= max(8, -(-(end - start) // PIECE_BYTES))


def test_touching_ranges_of_one_object_become_one_run_and_slices_scatter_it():
    a, b = ObjectVersion("k/a", 1000, '"1"'), ObjectVersion("k/b", 1000, '"2"')
    bufs = [memoryview(bytearray(n)) for n in (10, 20, 5, 7, 0)]
    runs = joined([(a, 100, bufs[0]), (a, 110, bufs[1]), (a, 200, bufs[2]), (b, 205, bufs[3]), (b, 212, bufs[4])])
    assert [(o.key, start, [len(v) for v in views]) for o, start, views in runs] == [
        ("k/a", 100, [10, 20]), ("k/a", 200, [5]), ("k/b", 205, [7])]
    obj, start, views = runs[0]
    parts = slices(start, views, 105, 115)
    assert [len(p) for p in parts] == [5, 5]
    for p, byte in zip(parts, (1, 2)):
        p[:] = bytes([byte]) * len(p)
    assert bytes(bufs[0]) == b"\0" * 5 + b"\1" * 5 and bytes(bufs[1][:6]) == b"\2" * 5 + b"\0"


class FakeClock:
    def __init__(self):
        self.now, self.slept = 0.0, []

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.now += seconds


def test_the_cap_spaces_requests_to_its_rate_and_is_shared_by_the_readers():
    assert reader_share(None, 4) is None
    assert reader_share(8.0, 4) == 8e9 / 8 / 4            # gigabits per second, split equally
    clock = FakeClock()
    pacer = Pacer(1000.0, clock=clock, sleep=clock.sleep)  # 1000 bytes/s
    starts = []
    for _ in range(5):
        pacer.wait(500)
        starts.append(clock.now)
        clock.now += 0.1                                   # the request itself takes 0.1 s
    assert starts == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0])
    assert pacer.waited == pytest.approx(4 * 0.4)
    idle = Pacer(None, clock=clock, sleep=clock.sleep)
    assert idle.wait(10**9) == 0.0


def test_the_cache_serves_only_whole_ranges_of_the_planned_version(tmp_path):
    old, new = ObjectVersion("m/a.safetensors", 100, '"aa"'), ObjectVersion("m/a.safetensors", 100, '"bb"')
    cache = NodeCache(str(tmp_path), "http://store", "bkt")
    data = bytes(range(100))
    cache.put(old, 10, [memoryview(data[10:30]), memoryview(data[30:40])])
    cache.put(old, 60, [memoryview(data[60:80])])
    # a range written by a process that died: never complete, never served
    (cache.folder(old) / f".tmp-1-2-{span_name(40, 60)}").write_bytes(data[40:50])
    (cache.folder(old) / span_name(80, 90)).write_bytes(data[80:85])   # wrong size: not a whole range
    later = NodeCache(str(tmp_path), "http://store", "bkt")            # the next load on the node
    assert later.parts(old, 0, 100) == [(0, 10, None), (10, 40, (10, 40)), (40, 60, None), (60, 80, (60, 80)),
                                        (80, 100, None)]
    out = bytearray(15)
    later.read_into(old, (10, 40), 20, [memoryview(out)[:5], memoryview(out)[5:]])
    assert bytes(out) == data[20:35]
    # the object changed on the server: its new version has nothing cached, and the old one is gone
    assert NodeCache(str(tmp_path), "http://store", "bkt").parts(new, 0, 100) == [(0, 100, None)]
    assert not cache.folder(old).exists()
    assert later.parts(ObjectVersion("m/a.safetensors", 100, '"aa"'), 0, 100) != [(0, 100, None)]  # in memory only
    with pytest.raises(OSError):
        later.read_into(old, (10, 40), 10, [memoryview(bytearray(5))])


def test_an_unwritable_cache_is_left_alone(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cache = NodeCache(str(blocker), "http://store", "bkt")
    cache.put(ObjectVersion("k", 10, '"e"'), 0, [memoryview(b"0123456789")])
    assert not cache.writable and cache.bytes_written == 0 and "cannot write" in caplog.text


@pytest.mark.parametrize("path,options,flag", [
    ("s3://b/p", dict(read_strategy="plain"), "--read-strategy"),
    ("s3://b/p", dict(verify_checksums=True), "--verify-checksums"),
    ("/data/ckpt", dict(max_gbps=2.0), "--max-gbps"),
    ("/data/ckpt", dict(cache_dir="/tmp"), "--cache-dir"),
])
def test_options_of_the_other_kind_of_checkpoint_are_refused_by_name(path, options, flag):
    with pytest.raises(OptionError, match=flag):
        validate_load_options(path, LoadOptions(**options))


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), True])
def test_max_gbps_must_be_a_rate(value):
    with pytest.raises(OptionError, match="--max-gbps"):
        LoadOptions(max_gbps=value)


def test_a_cache_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(OptionError, match="--cache-dir"):
        LoadOptions(cache_dir=str(tmp_path / "f"))


def test_the_header_parser_reads_fetched_bytes_as_it_reads_a_file(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(2, 3, dtype=torch.bfloat16)}, str(path))
    raw = path.read_bytes()
    n = header_length(raw[:8], len(raw), "m.safetensors")
    assert entries_from_header(raw[8:8 + n], len(raw), "m.safetensors") == parse_safetensors_header(path)
    with pytest.raises(CheckpointError, match="runs past the end"):
        header_length((len(raw)).to_bytes(8, "little"), len(raw), "m.safetensors")
    with pytest.raises(CheckpointError, match="shorter than the 8-byte"):
        header_length(raw[:5], 5, "m.safetensors")
    header = json.loads(raw[8:8 + n])
    header["a"]["data_offsets"][1] += 4
    text = json.dumps(header).encode()
    with pytest.raises(CheckpointError, match="tensor 'a'"):
        entries_from_header(text, 8 + len(text) + 36, "m.safetensors")


def test_credentials_are_scrubbed_from_messages():
    secret = "wJalrXUtnFEMI/K7MDENG/" + os.urandom(4).hex()
    assert redact(f"signature with {secret} and AKIA123 failed", (secret, "AKIA123", "")) == \
        "signature with *** and *** failed"
