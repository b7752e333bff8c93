"""The package face, in a fresh interpreter: `import distload.rules.names` or `import distload.plan` loads neither
the transfer engine nor torch.distributed (the pure wings stay cheap to import and to test)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from source_tree import ROOT, imports_process_group_at_load, package_modules


PROBE = "import sys, json, torch; before = set(sys.modules); import {0}; print(json.dumps(sorted(set(sys.modules) - before)))"


@pytest.mark.parametrize("module", ["distload.rules.names", "distload.plan"])
def test_pure_modules_import_without_the_transfer_engine(module):
    proc = subprocess.run([sys.executable, "-c", PROBE.format(module)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout.splitlines()[-1])
    ours = package_modules()
    heavy = [m for m in loaded if m == "distload.transfer" or m.startswith(("distload.transfer.", "torch.distributed"))]
    heavy += [f"{m} (imports torch.distributed)" for m in loaded if m in ours and imports_process_group_at_load(ours[m])]
    assert not heavy, f"`import {module}` loads ({len(loaded)} modules in all):\n" + "\n".join(heavy)
