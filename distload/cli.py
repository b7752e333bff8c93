"""Command line: `torchrun -m distload load|demo|verify ...`, `python -m distload inspect ...`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile


def _readers(value: str):
    from .topology import READER_CHOICES

    if value in ("per-node", "owners"):
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: choose {READER_CHOICES}") from None


class _ReadStrategies:
    """checkpoint.strategy.STRATEGIES, imported when argparse first looks (--read-strategy given, or the help):
    that package imports torch, and a refused option should not wait seconds for it on every rank."""

    def __iter__(self):
        from .checkpoint.strategy import STRATEGIES

        return iter(STRATEGIES)

    def __contains__(self, value) -> bool:
        return value in tuple(self)


def _add_load_options(p: argparse.ArgumentParser) -> None:
    from .options import TUNING_HELP

    p.epilog, p.formatter_class = TUNING_HELP, argparse.RawDescriptionHelpFormatter
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: the world size)")
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline stages (world = dp x pp x tp); each stage gets only its decoder layers")
    p.add_argument("--pp-layers", default=None, metavar="A,B,...",
                   help="layers per stage, summing to the model's layers (default: VLLM_PP_LAYER_PARTITION if set, "
                        "else vLLM's split)")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel size (divides the world size, or one stage's ranks with --pp)")
    p.add_argument("--readers", type=_readers, default="per-node",
                   help="'per-node' (local rank 0 of each node reads), N (N readers over the nodes), or 'owners' "
                        "(one node: each rank copies its own pieces from the page cache, no second copy)")
    p.add_argument("--config", default=None, help="rules file (TOML) instead of the one chosen from config.json")
    p.add_argument("--no-strict", dest="strict", action="store_false", help="warn about missing/unexpected instead of failing")
    p.add_argument("--device", default=None, help="device for params (default cuda:LOCAL_RANK if CUDA, else cpu)")
    p.add_argument("--backend", default=None, help="process-group backend (default nccl on CUDA, gloo on CPU)")
    p.add_argument("--timeout", dest="timeout_s", type=float, default=600.0,
                   help="seconds any collective may wait, and the bound on planning (default 600)")
    p.add_argument("--staging-mib", type=int, default=None,
                   help="size of one staging buffer (one bucket), MiB (default 16); a reader holds 4")
    p.add_argument("--read-strategy", default=None, choices=_ReadStrategies(), metavar="STRATEGY",
                   help="force a read strategy, one of %(choices)s (default: chosen from the file system, free RAM, the device and "
                        "the CPUs per rank; the choice and its reason are logged)")
    p.add_argument("--expert-placement", default="linear", choices=["linear", "round_robin"])
    p.add_argument("--expert-map", default=None, help="EPLB JSON file: per rank, the global expert ids it hosts")
    p.add_argument("--save-sharded", default=None, metavar="OUT", help="write each rank's shards + manifest to OUT")
    p.add_argument("--for", dest="save_for", default=None, metavar="SERVER",
                   help="with --save-sharded: OUT also holds what SERVER reads as it is (vllm: load_format="
                        "'sharded_state', tp = the world size)")
    p.add_argument("--report", default=None, metavar="FILE", help="write the report JSON to FILE (rank 0)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--quantize", default=None, choices=["fp8", "fp8-block", "fp8-channel"],
                   help="quantize a BF16/FP16 checkpoint's linear weights on each rank as they land: fp8 (one scale "
                        "per rank-local param), fp8-block (128x128 blocks) or fp8-channel (one per output row)")
    p.add_argument("--dequantize", action="store_true", help="turn an FP8 checkpoint's weights into BF16")
    p.add_argument("--reshard", action="store_true",
                   help="loading a --save-sharded directory saved on another topology: re-cut its shards for this job")
    p.add_argument("--no-checksums", dest="checksums", action="store_false",
                   help="reloading a --save-sharded directory: skip the sha256 check of the bytes read")
    p.add_argument("--verify-checksums", action="store_true",
                   help="before the transfer, readers check each weight file's sha256 against CKPT/checksums "
                        "(sha256sum output); a --save-sharded directory: its manifest's checksums")
    p.add_argument("--check-finite", action="store_true", help="after the transfer, scan every rank's params for NaN/Inf")
    p.add_argument("--mtp", default="off", choices=["off", "include", "only"],
                   help="multi-token-prediction (draft) layers of DeepSeek-V3/R1, GLM-4.5: off (default: read not at "
                        "all), include (the model and its MTP layers, on the last pipeline stage), only (the draft alone)")
    p.add_argument("--hf-config", default=None, metavar="DIR",
                   help="directory with the model's config.json (required for a torch.distributed.checkpoint dir)")


def load_options(args):
    """The LoadOptions of the parsed command line (the one place flags become options), every value and
    output path checked, on every rank before any rendezvous."""
    from .options import LoadOptions
    from .validate import read_expert_map, validate_load_options

    options = LoadOptions(tp=args.tp, pp=args.pp, pp_layers=args.pp_layers, ep=args.ep, readers=args.readers,
                          config=args.config, strict=args.strict,
                          device=args.device, backend=args.backend, timeout_s=args.timeout_s,
                          staging_mib=args.staging_mib, read_strategy=args.read_strategy,
                          expert_placement=args.expert_placement,
                          expert_map=read_expert_map(args.expert_map) if args.expert_map else None,
                          save_sharded=args.save_sharded, save_for=args.save_for, report=args.report, progress=args.progress,
                          reshard=args.reshard, checksums=args.checksums, hf_config=args.hf_config,
                          quantize=args.quantize, dequantize=args.dequantize,
                          verify_checksums=args.verify_checksums, check_finite=args.check_finite, mtp=args.mtp)
    if args.path is not None:  # demo without a path: it makes the checkpoint
        validate_load_options(args.path, options)
    return options


def cmd_load(args) -> int:
    options = load_options(args)
    from .loader import run_load  # after the checks: torch loads in seconds, a refusal needs none of it

    run_load(args.path, options)
    return 0


def cmd_inspect(args) -> int:
    from .inspect_cmd import describe_plan, inspect_load

    inspection = inspect_load(args.path, load_options(args), world=args.world, local_world=args.local_world,
                              rank=args.rank)
    print(describe_plan(inspection.plan, inspection.route, rank=args.rank, per_rank=args.per_rank or None,
                        inspection=inspection))
    return 0


def cmd_demo(args) -> int:
    from . import topology
    from .demo import make_demo_checkpoint
    from .loader import run_load
    from .transfer import barrier, broadcast_object

    options = load_options(args)
    topo = topology.from_environment(options)
    topology.init_process_group(topo)
    path = args.path
    if path is None:
        # One node makes the checkpoint where every rank of it can see it (the demo is single-node).
        path = broadcast_object(tempfile.mkdtemp(prefix="distload-demo-") if topo.rank == 0 else None, src=0)
    if topo.rank == 0 and not os.path.exists(os.path.join(path, "config.json")):
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
    _add_load_options(p)
    p.set_defaults(fn=cmd_load)
    p = sub.add_parser("inspect", help="show what each rank will get, without processes")
    p.add_argument("path")
    _add_load_options(p)
    p.add_argument("--world", type=int, default=None, help="world size (default: tp x pp)")
    p.add_argument("--local-world", type=int, default=None, help="ranks per node (default: all on one node)")
    p.add_argument("--rank", type=int, default=0, help="the rank whose planning, messages and bytes are shown")
    p.add_argument("--per-rank", action="store_true", help="the per-rank table at any world (default: up to 16)")
    p.set_defaults(fn=cmd_inspect)
    p = sub.add_parser("demo", help="make a small checkpoint and load it (run under torchrun)")
    p.add_argument("path", nargs="?", default=None, help="where to write the demo checkpoint (default: a temp dir)")
    _add_load_options(p)
    p.set_defaults(fn=cmd_demo)
    p = sub.add_parser("verify", help="load, run a tensor-parallel forward, compare with transformers")
    p.add_argument("path")
    _add_load_options(p)
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

    args = build_parser().parse_args(argv)
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


def _process_group_exists() -> bool:
    """Is there a process group to leave (none when the failure came before torch was even imported)?"""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()
