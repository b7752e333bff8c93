"""Cases: command-line options a user gets wrong (values, files they name, output paths)."""

from __future__ import annotations

import json

from .case import Case

MOE = "mixtral"   # 4 experts, 4 heads (tests/hf_models.py)


def _opts(*extra):
    def build(ckpt, ws):
        return [str(ckpt), *[a.format(ckpt=ckpt, ws=ws) for a in extra]]
    return build


def _expert_map(content, *extra):
    def build(ckpt, ws):
        path = ws / "eplb.json"
        if content is not None:
            path.write_text(content if isinstance(content, str) else json.dumps(content))
        return [str(ckpt), "--tp", "1", "--ep", "2", "--expert-map", str(path), *extra]
    return build


def _existing_file_out(ckpt, ws):
    (ws / "out").write_text("not a directory")
    return [str(ckpt), "--save-sharded", str(ws / "out")]


def _report_is_dir(ckpt, ws):
    (ws / "r.json").mkdir()
    return [str(ckpt), "--report", str(ws / "r.json")]


def _hf_config_empty_dir(ckpt, ws):
    (ws / "cfg").mkdir()
    return [str(ckpt), "--hf-config", str(ws / "cfg")]


def _empty_dir(ckpt, ws):
    (ws / "empty").mkdir()
    return [str(ws / "empty")]


CASES = [
    Case("timeout-zero", _opts("--timeout", "0"), names=("--timeout",)),
    Case("timeout-nan", _opts("--timeout", "nan"), names=("--timeout",)),
    Case("device-nonsense", _opts("--device", "nonsense"), names=("--device", "nonsense")),
    Case("device-cuda-absent", _opts("--device", "cuda:7"), names=("--device", "cuda:7")),
    Case("backend-nonsense", _opts("--backend", "carrier-pigeon"), names=("--backend",)),
    Case("staging-mib-zero", _opts("--staging-mib", "0"), names=("--staging-mib",)),
    Case("tp-zero", _opts("--tp", "0"), names=("--tp",)),
    Case("readers-zero", _opts("--readers", "0"), names=("--readers",)),
    Case("ep3-world2", _opts("--tp", "1", "--ep", "3"), base=MOE, names=("--ep 3",)),
    Case("expert-map-missing", _expert_map(None), base=MOE, names=("--expert-map", "eplb.json")),
    Case("expert-map-not-json", _expert_map("[[0, 1], [2,"), base=MOE, names=("--expert-map", "eplb.json")),
    Case("expert-map-strings", _expert_map([["a", "b"], ["c", "d"]]), base=MOE, names=("--expert-map",)),
    Case("expert-map-dict-no-ranks", _expert_map({"experts": [[0, 1], [2, 3]]}), base=MOE,
         names=("--expert-map", "ranks")),
    Case("report-missing-dir", _opts("--report", "{ws}/no/such/dir/r.json"), names=("--report", "no/such/dir")),
    Case("report-is-a-directory", _report_is_dir, names=("--report", "r.json")),
    Case("report-unwritable", _opts("--report", "/proc/distload-hostile.json"), names=("--report",)),
    Case("save-inside-checkpoint-dir", _opts("--save-sharded", "{ckpt}/sub"), names=("--save-sharded",)),
    Case("save-onto-existing-file", _existing_file_out, names=("--save-sharded", "out")),
    Case("save-unwritable", _opts("--save-sharded", "/proc/distload-hostile-out"), names=("--save-sharded",)),
    Case("hf-config-nonexistent", _opts("--hf-config", "/nonexistent"), names=("--hf-config", "/nonexistent")),
    Case("path-nonexistent", lambda ckpt, ws: [str(ws / "nonexistent-ckpt")], names=("nonexistent-ckpt",)),
]

# Further cases of the same kinds: `python -m tests.support.hostile --all` runs them too (kept out of the suite's time).
EXTRA = [
    Case("timeout-negative", _opts("--timeout", "-1"), names=("--timeout",)),
    Case("staging-mib-negative", _opts("--staging-mib", "-4"), names=("--staging-mib",)),
    Case("tp-negative", _opts("--tp", "-2"), names=("--tp",)),
    Case("tp3-on-4-heads", _opts("--tp", "3"), base="llama", nproc=3, names=("num_attention_heads=4",)),
    Case("expert-map-three-ranks", _expert_map([[0], [1, 2], [3]]), base=MOE, names=("--expert-map",)),
    Case("expert-map-duplicate", _expert_map([[0, 1], [1, 2]]), base=MOE, names=("--expert-map",)),
    Case("save-into-checkpoint-dir", _opts("--save-sharded", "{ckpt}"), names=("--save-sharded",)),
    Case("hf-config-no-config-json", _hf_config_empty_dir, names=("--hf-config", "config.json")),
    Case("verify-checksums-no-file", _opts("--verify-checksums"), names=("checksums",)),
    Case("tp3-world4", _opts("--tp", "3"), nproc=4, names=("--tp 3",)),
    Case("readers-negative", _opts("--readers", "-1"), names=("--readers",)),
    Case("expert-map-expert-9", _expert_map([[0, 1], [2, 9]]), base=MOE, names=("--expert-map",)),
    Case("path-empty-dir", _empty_dir, names=("empty",)),
]
