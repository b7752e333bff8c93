"""A distload error inside an engine's workers is said again, last, by the engine's top process: one line per
distinct message, naming the ranks (engines/contract.py; the vLLM stage shows it under vLLM's own server)."""

from __future__ import annotations

import pytest

from distload.engines.contract import FAILURES, say_failures, surfaced
from distload.errors import CheckpointError, OptionError


def test_each_workers_error_is_said_once_per_message_with_its_ranks(tmp_path, monkeypatch, capsys):
    record = tmp_path / "failures"
    record.write_text("")
    monkeypatch.setenv(FAILURES, str(record))
    for rank, error in ((1, OptionError("\"readers\": 'x': choose")), (0, OptionError("\"readers\": 'x': choose")),
                        (0, CheckpointError("f.safetensors: truncated\nsecond line"))):
        with pytest.raises(type(error)), surfaced(rank):
            raise error
    with pytest.raises(ValueError), surfaced(0):   # not distload's: vLLM's own tracebacks tell it
        raise ValueError("not ours")
    say_failures(str(record))
    assert capsys.readouterr().err.splitlines() == [
        "distload: error on ranks 0, 1: \"readers\": 'x': choose",
        "distload: error on rank 0: f.safetensors: truncated"]
    assert not record.exists()


def test_nothing_is_said_when_nothing_failed(tmp_path, capsys):
    record = tmp_path / "failures"
    record.write_text("")
    say_failures(str(record))
    assert capsys.readouterr().err == ""
