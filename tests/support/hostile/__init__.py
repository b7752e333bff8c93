"""A hostile-input corpus, run like a user: each case a real `torchrun -m distload load ...` job built
from a tiny checkpoint (damaged headers, tensors whose shape or dtype lies, a config.json that lies, bad
options and output paths, damaged sharded saves, ranks lost early), classified as ok, refused,
traceback, hang, silent-wrong, misnamed (refused without naming the cause) or messy (not every rank
printed one error line and exited nonzero). tests/test_hostile.py asserts every case's expected outcome;
`python -m tests.support.hostile [--all] [CASE ...]` prints the table.
"""

from . import (cases_config, cases_maps, cases_options, cases_quant4, cases_rules, cases_runtime, cases_saves,
               cases_tensors, cases_topology)
from .bases import make_bases
from .case import Case
from .runner import Result, run_corpus, table

_MODULES = (cases_tensors, cases_config, cases_options, cases_runtime, cases_quant4, cases_maps, cases_saves,
            cases_rules, cases_topology)
CASES: list[Case] = [c for m in _MODULES for c in m.CASES]            # what tests/test_hostile.py runs
ALL_CASES: list[Case] = CASES + [c for m in _MODULES for c in m.EXTRA]  # `python -m tests.support.hostile --all`

__all__ = ["ALL_CASES", "CASES", "Case", "Result", "make_bases", "run_corpus", "table"]
