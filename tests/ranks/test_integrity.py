"""--verify-checksums hashes the bytes the transfer reads (distload/checkpoint/integrity.py HashingReader): a file
changed while a load runs cannot be loaded and reported verified."""

from __future__ import annotations

import hashlib
import os
from contextlib import closing
from pathlib import Path

import pytest

from distload.checkpoint import RangeReader
from distload.demo import make_demo_checkpoint
from distload.errors import DistloadError
from distload.checkpoint.integrity import CHECKSUMS_FILE, HashingReader

from spawn import run_ranks


def write_checksums(root: Path) -> None:
    files = sorted(p for p in root.iterdir() if p.suffix in (".safetensors", ".bin"))
    (root / CHECKSUMS_FILE).write_text("".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n"
                                               for p in files))


@pytest.fixture
def files(tmp_path):
    (tmp_path / "a.safetensors").write_bytes(bytes(range(256)) * 64)       # 16 KiB
    (tmp_path / "b.safetensors").write_bytes(b"\x07" * 5000)
    write_checksums(tmp_path)
    return tmp_path


def hashing_reader(root: Path, files=("a.safetensors", "b.safetensors")) -> HashingReader:
    return HashingReader(RangeReader(str(root)), str(root), list(files), (0,), 0)


def read(reader, name: str, offset: int, n: int) -> bytes:
    buf = bytearray(n)
    reader.read_into(name, offset, memoryview(buf))
    return bytes(buf)


def test_whole_file_in_order_and_untouched_files_verify(files):
    with closing(hashing_reader(files)) as r:
        for at in range(0, 16384, 4096):
            read(r, "a.safetensors", at, 4096)
        assert r.finish() == []       # b.safetensors, never read, is hashed whole
        assert r.files_verified() == 2


def test_ranges_with_gaps_are_completed_for_the_hash(files):
    with closing(hashing_reader(files)) as r:
        assert read(r, "a.safetensors", 1000, 100) == (bytes(range(256)) * 64)[1000:1100]
        read(r, "a.safetensors", 9000, 3)
        assert r.finish() == []


def test_a_range_read_again_cannot_be_vouched_for(files):
    with closing(hashing_reader(files)) as r:
        read(r, "a.safetensors", 4096, 100)
        read(r, "a.safetensors", 0, 100)
        problems = r.finish()
    assert len(problems) == 1 and "a.safetensors" in problems[0] and "read again" in problems[0]


def test_bytes_changed_before_they_are_read_are_the_ones_hashed(files):
    with closing(hashing_reader(files)) as r:
        read(r, "a.safetensors", 0, 4096)
        with open(files / "a.safetensors", "r+b") as fh:   # changed mid-load, after the first range
            fh.seek(8000)
            fh.write(b"\xff")
        assert read(r, "a.safetensors", 7999, 2)[1:] == b"\xff"   # what was loaded is the changed byte ...
        problems = r.finish()
    assert len(problems) == 1 and "a.safetensors" in problems[0] and "but checksums says" in problems[0]


def test_file_missing_from_the_list_or_shrunk(files):
    (files / CHECKSUMS_FILE).write_text((files / CHECKSUMS_FILE).read_text().splitlines()[0] + "\n")
    with closing(hashing_reader(files)) as r:
        read(r, "a.safetensors", 0, 10)
        os.truncate(files / "a.safetensors", 5)
        problems = r.finish()
    assert any("b.safetensors: not listed" in p for p in problems)
    assert any("a.safetensors" in p for p in problems)


# ----------------------------------------------------------------------------------------------------
# A real load (2 gloo ranks) while a reader hook changes a weight file under it


VICTIM = "model-00001-of-00003.safetensors"


def _load_while_a_file_changes(path: str) -> list:
    import distload

    outcomes = [distload.load(path, verify_checksums=True, progress=False).report["ok"]]
    original = RangeReader.read_into

    def change_then_read(self, entry_file, offset, out, tally=True):
        # The reader hook: the first read of the victim on the reader rank flips its last byte first,
        # as a file replaced or rewritten during the load would.
        if entry_file == VICTIM and not getattr(change_then_read, "done", False):
            change_then_read.done = True
            with open(os.path.join(path, VICTIM), "r+b") as fh:
                fh.seek(-1, os.SEEK_END)
                last = fh.read(1)
                fh.seek(-1, os.SEEK_END)
                fh.write(bytes([last[0] ^ 0x01]))
        return original(self, entry_file, offset, out, tally)

    RangeReader.read_into = change_then_read
    try:
        distload.load(path, verify_checksums=True, progress=False)
        outcomes.append("loaded")
    except DistloadError as exc:
        outcomes.append(str(exc))
    finally:
        RangeReader.read_into = original
    return outcomes


def test_a_file_changed_during_the_load_is_refused(tmp_path):
    ckpt = make_demo_checkpoint(tmp_path / "ckpt")
    write_checksums(ckpt)
    for rank, (first, second) in enumerate(run_ranks(2, _load_while_a_file_changes, str(ckpt))):
        assert first is True, f"rank {rank}: the unchanged checkpoint did not verify"
        assert second != "loaded", f"rank {rank}: loaded a file changed during the load"
        assert "--verify-checksums" in second and VICTIM in second and "but checksums says" in second, second
