"""Command line: `torchrun -m distload load|demo|verify ...`, `python -m distload inspect ...`."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile


def _argparse_type(parse):
    """options' `parse` (raising OptionError) as an argparse type (argparse reports ArgumentTypeError itself)."""
    def convert(text):
        from .errors import DistloadError

        try:
            return parse(text)
        except DistloadError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return convert


def _add_options(p: argparse.ArgumentParser, scope: str | None) -> None:
    """The declared options (options.LoadOptions) of `scope` as flags of `p`: each declared once, in options.py."""
    from .options import TUNING_HELP, declared, flag_of

    p.epilog, p.formatter_class = TUNING_HELP, argparse.RawDescriptionHelpFormatter
    for f in declared(scope):
        meta, cli = f.metadata, dict(f.metadata["cli"])
        kwargs = dict(dest=f.name, help=meta["help"])
        if isinstance(f.default, bool):
            kwargs["action"] = "store_false" if f.default else "store_true"
        else:
            kwargs["default"] = f.default
            parse = cli.pop("parse", None)
            if parse is not None:   # the command line's text -> the option's value (a file read, a number)
                kwargs["type"] = _argparse_type(parse)
            kwargs.update(cli)
        p.add_argument(flag_of(f), **kwargs)


def load_options(args, scope: str | None = None):
    """The LoadOptions of the parsed command line (the one place flags become options), every value and output
    path checked, on every rank before any rendezvous."""
    from .options import LoadOptions, declared
    from .validate import validate_load_options

    options = LoadOptions(**{f.name: getattr(args, f.name) for f in declared(scope)})
    if args.path is not None:  # demo without a path: it makes the checkpoint
        validate_load_options(args.path, options)
    return options


def cmd_load(args) -> int:
    options = load_options(args)
    from .loader import run_load  # after the checks: torch loads in seconds, a refusal needs none of it

    run_load(args.path, options)
    return 0


def cmd_inspect(args) -> int:
    from .inspect_cmd import describe_plan, inspect_load, prediction_lines

    from .options import PLAN

    inspection = inspect_load(args.path, load_options(args, PLAN), world=args.world, local_world=args.local_world,
                              rank=args.rank)
    print(describe_plan(inspection.plan, inspection.route, rank=args.rank, per_rank=args.per_rank or None,
                        inspection=inspection))
    if args.cluster:
        print(prediction_lines(inspection.plan, args.cluster))
    return 0


def cmd_demo(args) -> int:
    from . import topology
    from .transfer import broadcast_object

    options = load_options(args)
    topo = topology.from_environment(options)
    topology.init_process_group(topo)
    if args.path is not None:
        return demo_in(args.path, topo.rank, options)
    # One node makes the checkpoint where every rank of it can see it (the demo is single-node), and removes it after.
    path = broadcast_object(tempfile.mkdtemp(prefix="distload-demo-") if topo.rank == 0 else None, src=0)
    try:
        return demo_in(path, topo.rank, options)
    finally:
        if topo.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
            print(f"distload demo: removed {path} (give the demo a PATH to keep its checkpoint)", flush=True)


def demo_in(path: str, rank: int, options) -> int:
    """The demo's load of the checkpoint at `path` (made there first when it has none), and its per-rank lines."""
    from .demo import make_demo_checkpoint
    from .loader import run_load
    from .transfer import barrier

    if rank == 0 and not os.path.exists(os.path.join(path, "config.json")):
        make_demo_checkpoint(path)
        print(f"distload demo: wrote a Llama-shaped bf16 checkpoint (3 safetensors files) to {path}", flush=True)
    barrier()
    result = run_load(path, options)
    if result.rank == 0:
        for r in result.report["per_rank"]:
            print(f"  rank {r['rank']}: read {r['bytes_read']:>10,} B from storage ({r['files_opened']} files), "
                  f"received {r['bytes_received']:>10,} B"
                  + (f" ({r['bytes_from_other_nodes']:,} B from other nodes)" if r.get("bytes_from_other_nodes") else "")
                  + f", sent {r['bytes_sent']:>10,} B, "
                  f"peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB")
    return 0 if result.report["ok"] else 1


def cmd_verify(args) -> int:
    options = load_options(args)
    from .verify import parse_input_ids, verify

    return verify(args.path, input_ids=parse_input_ids(args.input_ids), dtype=args.dtype, tolerance=args.tolerance,
                  logits_file=args.save_logits, reference=args.reference, options=options).verdict.exit_code


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad option refused as every other bad input is: one line per rank, naming the option
    and the fix (argparse's usage block and message, printed by every rank, interleave on a shared terminal)."""

    def error(self, message: str):
        rank = os.environ.get("RANK", "0")
        sys.stderr.write(f"distload: error on rank {rank}: {self.prog}: {message} (see `{self.prog} --help`)\n")
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="distload", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("load", help="load a checkpoint onto every rank (run under torchrun)")
    p.add_argument("path")
    _add_options(p, None)
    p.set_defaults(fn=cmd_load)
    p = sub.add_parser("inspect", help="show what each rank will get, without processes")
    p.add_argument("path")
    _add_options(p, "plan")
    p.add_argument("--world", type=int, default=None, help="world size (default: tp x pp)")
    p.add_argument("--local-world", type=int, default=None, help="ranks per node (default: all on one node)")
    p.add_argument("--rank", type=int, default=0, help="the rank whose planning, messages and bytes are shown")
    p.add_argument("--per-rank", action="store_true", help="the per-rank table at any world (default: up to 16)")
    p.add_argument("--cluster", default=None, metavar="KEY=VALUE,...",
                   help="predict the load time on a cluster of --world / --local-world GPUs, e.g. "
                        "'storage=shared,storage-gbps=20,nic-gbit=400' (keys: distload/plan/predict.py KEYS)")
    p.set_defaults(fn=cmd_inspect)
    p = sub.add_parser("demo", help="make a small checkpoint and load it (run under torchrun)")
    p.add_argument("path", nargs="?", default=None, help="where to write the demo checkpoint (default: a temp dir)")
    _add_options(p, None)
    p.set_defaults(fn=cmd_demo)
    p = sub.add_parser("verify", help="load, run a tensor-parallel forward, compare with transformers")
    p.add_argument("path")
    _add_options(p, None)
    p.add_argument("--input-ids", default="1,17,42,7", help="one sequence of token ids, comma-separated")
    p.add_argument("--save-logits", default=None, metavar="FILE",
                   help="write distload's logits [tokens, vocab] float32 as tensor 'logits' to a safetensors FILE")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype of the forward")
    p.add_argument("--reference", default=None, metavar="DIR",
                   help="the checkpoint transformers runs for the comparison (default: PATH); the same weights in an "
                   "architecture transformers builds offline, e.g. InternLM2 converted to Llama")
    p.add_argument("--tolerance", type=float, default=2e-2,
                   help="fail above this max |distload - transformers| / max |transformers| (or if argmax differs)")
    p.set_defaults(fn=cmd_verify)
    from .rules_cmd import add_rules_parser  # `distload rules check FILE CKPT`

    add_rules_parser(sub)
    return parser


def main(argv=None) -> int:
    from .errors import DistloadError

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        parser.error(_unrecognized(args.command, extra))
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if (rank == 0 or args.verbose) else logging.WARNING,
                        format=f"[distload rank {rank}] %(message)s")
    try:
        return args.fn(args)
    except DistloadError as exc:
        # One write per line: ranks share the terminal, and print() writes the newline separately.
        sys.stderr.write(f"distload: error on rank {rank}: {exc}\n")
        sys.stderr.flush()
        if _process_group_exists():
            from .transfer import report_together

            report_together()
        return 1
    finally:
        if _process_group_exists():
            sys.modules["torch.distributed"].destroy_process_group()


def _unrecognized(command: str, extra: list[str]) -> str:
    """argparse's refusal of unknown arguments, except that a load's flag given to `inspect` is named as such."""
    from .options import LOAD, declared, flag_of

    load_only = [flag_of(f) for f in declared() if f.metadata["scope"] == LOAD and flag_of(f) in extra]
    if command == "inspect" and load_only:
        return (f"{', '.join(load_only)}: option{'s' if len(load_only) > 1 else ''} of `distload load`; inspect "
                f"plans a load and writes nothing: drop {'them' if len(load_only) > 1 else 'it'}")
    return f"unrecognized arguments: {' '.join(extra)}"


def _process_group_exists() -> bool:
    """Is there a process group to leave (none when the failure came before torch was even imported)?"""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()
