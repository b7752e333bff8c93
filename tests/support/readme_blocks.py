"""The README's commands as the tests and the vLLM stage run them: the fenced block after a line
`<!-- block: NAME ... -->`, verbatim, and the stamp of the vLLM install (what a venv built by that block records).

    python3 tests/support/readme_blocks.py NAME      # print the block
    python3 tests/support/readme_blocks.py --stamp   # print the install stamp

Plain Python (no distload, no torch): scripts/vllm_stage.sh runs it before any venv exists.
"""

from __future__ import annotations

import hashlib
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
INSTALL = "vllm-install"
STAMP_FILE = ".distload-readme-install"   # in the venv the install block made: its stamp


def block(name: str, readme: Path = README) -> str:
    """The fenced block that follows the marker `<!-- block: NAME` (ValueError when there is none)."""
    text = readme.read_text(encoding="utf-8")
    match = re.search(rf"^<!-- block: {re.escape(name)}\b.*?-->\n```[a-z]*\n(.*?)^```", text, re.M | re.S)
    if match is None:
        raise ValueError(f"{readme}: no fenced block after '<!-- block: {name} -->'")
    return match.group(1)


def command(name: str, readme: Path = README) -> str:
    """A block's one command, its continuation lines joined (a shell runs it as written)."""
    return re.sub(r"\\\n\s*", "", block(name, readme)).strip()


def install_stamp(root: Path = ROOT) -> str:
    """What makes a vLLM venv: the README's install block, the script it runs and the `vllm` extra it installs.
    A venv whose stamp differs was made by other commands, and the stage makes it again."""
    extra = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]["vllm"]
    parts = [block(INSTALL, root / "README.md"), (root / "scripts" / "setup.sh").read_text(), repr(extra)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


if __name__ == "__main__":
    arg = sys.argv[1] if len(sys.argv) == 2 else "--help"
    if arg == "--help":
        print(__doc__)
    else:
        print(install_stamp() if arg == "--stamp" else block(arg), end="" if arg != "--stamp" else "\n")
