"""`python -m tests.support.hostile [--all] [-j JOBS] [CASE ...]`: run the corpus (or the named cases) and print the table."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from . import ALL_CASES, CASES, make_bases, run_corpus, table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.support.hostile", description=__doc__)
    p.add_argument("cases", nargs="*", help="case ids (default: all); a case a named one copies from runs too")
    p.add_argument("--all", action="store_true", help="the suite's cases and the further ones of the same kinds")
    p.add_argument("-j", "--jobs", type=int, default=4, help="jobs at a time")
    p.add_argument("--keep", default=None, metavar="DIR", help="work in DIR (kept: every rank's output)")
    args = p.parse_args(argv)
    pool = ALL_CASES if args.all or args.cases else CASES
    by_id = {c.id: c for c in pool}
    unknown = [c for c in args.cases if c not in by_id]
    if unknown:
        p.error(f"unknown cases {unknown}")
    chosen = [by_id[c] for c in args.cases] or pool
    chosen = [by_id[c.after] for c in chosen if c.after and c.after not in args.cases and args.cases] + chosen
    root = Path(args.keep or tempfile.mkdtemp(prefix="distload-hostile-"))
    root.mkdir(parents=True, exist_ok=True)
    bases = make_bases(root, {c.base for c in chosen if c.base})
    results = run_corpus(list({c.id: c for c in chosen}.values()), root, bases, jobs=args.jobs)
    print(table(results))
    wrong = [r for r in results if r.outcome != r.case.expect]
    print(f"\n{len(results)} cases, {len(results) - len(wrong)} as expected, {len(wrong)} not; outputs in {root}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
