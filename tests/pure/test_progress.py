"""What a load says while it runs and when it ends: the progress modes (a bar on a terminal, log lines for an engine's
workers, nothing in a pipe), units that fit the size, and options refused in the words their caller used."""

from __future__ import annotations

import io

import pytest

from distload.errors import OptionError
from distload.options import LoadOptions, as_config_keys
from distload.report import summary_line
from distload.serving.export import resolve_save_for
from distload.serving.names import installed_version
from distload.serving.vllm_save import DISTRIBUTIONS
from distload.transfer import progress
from distload.transfer.progress import BAR, LOG, Progress, mode_of, rate, size


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_units_fit_the_size():
    assert [size(n) for n in (640, 7_340_032, 412_300_000, 1_240_000_000, 3.5e12)] == \
        ["640 B", "7.34 MB", "412.3 MB", "1.24 GB", "3.50 TB"]
    assert rate(7_340_032, 2.0) == "3.67 MB/s" and rate(1, 0) == "-/s"


def test_only_rank_0_shows_and_a_pipe_gets_no_bar():
    assert mode_of(True, 0, Terminal()) == BAR
    assert mode_of(True, 0, io.StringIO()) is None      # not a terminal
    assert mode_of(True, 1, Terminal()) is None
    assert mode_of(False, 0, Terminal()) is None
    assert mode_of("log", 0, io.StringIO()) == LOG and mode_of("log", 1, io.StringIO()) is None


def test_the_bar_ends_full_on_its_own_line():
    out = Terminal()
    bar = Progress(3_000_000, BAR, stream=out)
    for _ in range(3):
        bar.advance(1_000_000)
    bar.close()
    text = out.getvalue()
    assert text.endswith("\n") and text.count("\n") == 1
    assert "distload [" + "#" * progress.WIDTH + "] 3.00/3.00 MB (100%)" in text


def test_log_lines_for_an_engines_workers(monkeypatch):
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)
    out = io.StringIO()
    bar = Progress(2_000_000_000, LOG, stream=out)
    bar.advance(500_000_000)
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("distload: loading 0.50/2.00 GB (25%), "), lines


def test_silent_progress_writes_nothing():
    out = Terminal()
    bar = Progress(10, None, stream=out)
    bar.advance(10)
    bar.close()
    assert out.getvalue() == ""


def test_the_summary_line_says_what_params_counts_in_units_that_fit():
    report = {"ok": True, "family": "llama", "world_size": 2, "tp": 2, "ep": 1, "readers": [0], "params": 30,
              "checkpoint_bytes": 7_340_032, "storage_bytes_read": 7_340_032, "seconds": {"total": 0.5},
              "per_rank": [{"peak_rss_bytes": 250_000_000}], "verdict": "every param loaded exactly once"}
    line = summary_line(report)
    assert "param_shards=30 (over 2 ranks)" in line
    assert "checkpoint=7.34 MB read=7.34 MB in 0.50s (14.68 MB/s)" in line and "0.000 GB" not in line


def test_options_are_checked_as_argparse_would_from_python_too():
    with pytest.raises(OptionError, match=r"--read-strategy 'fast': choose one of plain, threaded"):
        LoadOptions(read_strategy="fast")
    with pytest.raises(OptionError, match=r"--check-finite 'yes': a switch, True or False"):
        LoadOptions(check_finite="yes")
    assert LoadOptions(progress="log").progress == "log"


def test_an_engines_config_error_names_the_key_as_written():
    assert as_config_keys("--readers 'x': choose 'per-node', 'owners' or a number") == \
        "\"readers\": 'x': choose 'per-node', 'owners' or a number"
    assert as_config_keys("--timeout 0: above 0 (e.g. --timeout 600)") == '"timeout_s": 0: above 0 (e.g. "timeout_s": 600)'
    assert as_config_keys("--hf-config DIR") == "--hf-config DIR"   # not an engine's key: left as it is


def test_for_an_engine_names_its_version_before_anything_is_read():
    assert resolve_save_for(None) is None
    assert resolve_save_for("vllm==0.32.0") == "vllm==0.32.0"
    with pytest.raises(OptionError, match=r"--for vllm==0\.99\.1: vllm 0\.99\.1: distload does not know .*vllm\.toml"):
        resolve_save_for("vllm==0.99.1")
    installed = installed_version(DISTRIBUTIONS)
    if installed is None:
        with pytest.raises(OptionError, match=r"--for vllm: vllm is not installed here .* --for vllm==VERSION "
                                              r"\(e\.g\. --for vllm==0\.32\.0\)"):
            resolve_save_for("vllm")
    else:
        assert resolve_save_for("vllm") == f"vllm=={installed}"
