"""distload/sharded/save.py: a save that cannot be written says where, why and what to do, on the rank it
failed on (never a raw OSError), and one that cannot fit is refused before a byte is written."""

from __future__ import annotations

import errno
import shutil

import pytest

from distload.errors import CheckpointError
from distload.sharded.save import check_free_space, named_os_errors


def test_no_room_refused_before_writing(tmp_path):
    out = tmp_path / "new" / "save"
    with pytest.raises(CheckpointError, match=r"--save-sharded .*needs 1125\.9 TB, .* has \S+ [kMGT]?B free"):
        check_free_space(out, 2 ** 50)
    check_free_space(out, 1)
    assert not (tmp_path / "new").exists()


def test_no_room_for_a_small_save_names_sizes_that_are_not_zero(tmp_path, monkeypatch):
    # a disk with 640 bytes free and a 3.5 MB save: each in a unit that shows it, never "0.00 GiB"
    monkeypatch.setattr("shutil.disk_usage", lambda path: shutil._ntuple_diskusage(10 ** 9, 10 ** 9 - 640, 640))
    with pytest.raises(CheckpointError) as info:
        check_free_space(tmp_path / "save", 3_500_000)
    message = str(info.value)
    assert "needs 3.50 MB" in message and "has 640 B free" in message and "0.00" not in message


@pytest.mark.parametrize("code,fix", [(errno.ENOSPC, "disk is full"), (errno.EROFS, "read-only"),
                                      (errno.EIO, "fix the cause")])
def test_os_errors_named(tmp_path, code, fix):
    def fail():
        raise OSError(code, "boom", str(tmp_path / "rank-00001-of-00002.safetensors"))

    with pytest.raises(CheckpointError) as info:
        named_os_errors(tmp_path, fail)()
    message = str(info.value)
    assert "--save-sharded" in message and "rank-00001-of-00002.safetensors" in message and fix in message
    assert named_os_errors(tmp_path, lambda: 7)() == 7
