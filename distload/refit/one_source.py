"""Live refit (RL weight sync): one source rank pushes new weights; every rank takes only its shards, in place.

    result = distload.load(path, tp=4)                       # once
    distload.refit(result, trainer_state_dict if rank == src else None, src=0)   # every update, on every rank

The source holds full tensors under checkpoint (Hugging Face) names. Only their names, dtypes and shapes
travel as metadata; from them every rank builds the same plan a load of a checkpoint with those tensors
would get (same rules, same layout), with the source as the single reader. `MemoryReader` serves the
source's reads from its tensors instead of files, so the bytes move through transfer/ like any load:
bounded staging buckets, broadcast or point-to-point, each rank receiving only what it keeps, written
into the existing params in place. Then reconcile.py checks that every element was written exactly once
and that replicas agree.

Versioning and all-or-nothing: each update carries a version (default: the current one + 1), and the new
version becomes visible (`result.version`, the returned `Refit.version`) only after every rank
acknowledged it in the final agreement step. Everything that can be refused is checked on metadata,
before any byte moves: names (missing / unexpected, with the rules' messages), and per param its global
shape, this rank's local shape and dtype against the loaded one, plus versions (every rank at the same
one, the new one newer). The bytes then go straight into the live params, with no second copy of the
model (memory stays at the staging buckets). The price: if the transfer itself fails midway (a rank dies,
a link breaks), the params are partly updated, undefined; refit raises RefitFailed saying so, the
version is not advanced, and the caller must refit again (or reload) before serving from them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import torch

from ..rules import names
from .. import topology
from ..checkpoint.discover import read_config
from ..checkpoint.header import TensorEntry
from ..transfer.delivery import transfer_phase
from ..dtypes import TORCH_TO_SAFETENSORS, itemsize, torch_dtype
from ..errors import DistloadError, PlanError, RankFailure
from ..loader import LoadResult
from ..options import LoadOptions
from ..plan import DEFAULT_STAGING_BYTES, build_plan
from ..postprocess import PostProcess
from ..quant import for_load
from ..reconcile import reconcile
from ..rules import rules_for
from ..transfer import broadcast_object
from ..transfer.collectives import max_over_ranks
from ..transfer.agreement import run_phase


class RefitFailed(DistloadError):
    """The update failed after bytes started moving: params are partly updated; the version was not advanced."""


@dataclass
class Refit:
    version: int
    params: int
    report: dict = field(default_factory=dict)


class MemoryReader:
    """The reader interface of checkpoint.RangeReader over in-memory tensors: a tensor's name is its 'file'.

    Only the tensor being read is kept as a byte view (a non-contiguous tensor is copied once, one at a time).
    """

    strategy = None  # no storage: checkpoint.Reader's strategy where none applies

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors
        self.bytes_read = 0
        self.files_opened: set[str] = set()
        self._current: tuple[str, torch.Tensor] | None = None

    def read_into(self, file: str, offset: int, out: torch.Tensor) -> int:
        if self._current is None or self._current[0] != file:
            self._current = (file, self.tensors[file].detach().contiguous().reshape(-1).view(torch.uint8))
        flat = self._current[1]
        n = out.numel()
        out.view(-1).copy_(flat[offset:offset + n])  # device -> host when the source tensors live on a GPU
        self.bytes_read += n
        return n

    def read_many(self, ranges) -> int:
        return sum(self.read_into(f, offset, out) for f, offset, out in ranges)

    def prefetch(self, file: str, offset: int, nbytes: int) -> None:
        """Nothing to fetch: the tensors are in memory."""

    def close(self) -> None:
        self._current = None


def _phase(name: str, fn):
    return run_phase(f"refit ({name})", fn)


def destination(target, config, layout_options: LoadOptions, rules_path: str | None):
    """(params, current specs or None, layout, config, rules, current version) for a LoadResult, module or dict."""
    if isinstance(target, LoadResult):
        rules = rules_for(target.config, rules_path)
        if rules.name != target.plan.family:
            raise PlanError(f"refit: the params were loaded with rules family {target.plan.family!r}, this refit "
                            f"chose {rules.name!r} ({rules.source}); pass the rules used for the load (rules=PATH)")
        return target.params, target.specs, target.plan.layout, target.config, rules, target.version
    if config is None:
        raise DistloadError("refit into a module or a dict of params needs config= (the model's config.json as a "
                            "dict, or the directory holding it); a LoadResult carries its own")
    if not isinstance(config, dict):
        config = read_config(str(config))
    if isinstance(target, torch.nn.Module):
        data_of: dict[int, torch.Tensor] = {}
        params = {n: data_of.setdefault(id(p), p.data) for n, p in target.named_parameters(remove_duplicate=False)}
    else:
        params = dict(target)
    layout = topology.from_environment(layout_options).layout
    return params, None, layout, config, rules_for(config, rules_path), 0


def _metadata(tensors: dict) -> dict:
    meta = {}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise DistloadError(f"refit: {name!r} is a {type(t).__name__}, not a tensor")
        if t.dtype not in TORCH_TO_SAFETENSORS:
            raise DistloadError(f"refit: {name!r} has dtype {t.dtype}, which distload does not support")
        meta[name] = (TORCH_TO_SAFETENSORS[t.dtype], tuple(t.shape))
    return meta


def mismatches(plan, rank: int, current: dict | None, params: dict) -> list[str]:
    """Per param: what the update would make it (from which update tensors) vs what this rank holds."""
    feeds: dict[str, set[str]] = {}
    for src in plan.sources.values():
        for d in src.deliveries:
            feeds.setdefault(d.param, set()).add(src.name)
    problems = []
    for name, spec in sorted(plan.specs[rank].items()):
        origin = f" (from {names.describe(feeds[name])})" if name in feeds else ""
        if name not in params:
            problems.append(f"{name}: not among this rank's params")
            continue
        if current is not None:
            have = current[name]
            if tuple(have.global_shape) != tuple(spec.global_shape) or have.dtype != spec.dtype:
                problems.append(f"{name}: the update makes it {spec.dtype}{list(spec.global_shape)}{origin}, the "
                                f"loaded param is {have.dtype}{list(have.global_shape)}")
                continue
        t = params[name]
        if tuple(t.shape) != tuple(spec.local_shape) or t.dtype != torch_dtype(spec.dtype):
            problems.append(f"{name}: the update gives this rank a {spec.dtype}{list(spec.local_shape)} shard"
                            f"{origin}, the param is {TORCH_TO_SAFETENSORS.get(t.dtype, t.dtype)}{list(t.shape)}")
    return problems


def refit(target, named_tensors=None, *, src: int = 0, group=None, version: int | None = None, config=None,
          tp: int | None = None, ep: int = 1, pp: int = 1, pp_layers=None, rules: str | None = None,
          partial: bool = False,
          staging_mib: int | None = None, quantize: str | None = None, dequantize: bool = False) -> Refit:
    """Push `named_tensors` (checkpoint names -> full tensors, on rank `src`; ignored elsewhere) into `target`
    on every rank: a LoadResult (its version advances; its layout, pipeline stages included, is the load's), an
    nn.Module or a dict of params in the serving layout (then pass config= and tp= / ep= / pp= / pp_layers=:
    under pp a rank's params are its stage's, and it receives only those). `partial=True` allows updating a subset of the params (each one whole).
    quantize= / dequantize= as given to the load (an online-quantized load refits from high-precision
    tensors). Call it on every rank. Returns the acknowledged version."""
    if group is not None:
        import torch.distributed as dist

        if group is not dist.group.WORLD:
            raise DistloadError("refit over a process sub-group is not supported yet (the transfer uses the default "
                                "group): make the serving ranks and the source one job, and pass group=None")
    start = time.perf_counter()
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    tensors = dict(named_tensors or {}) if rank == src else {}  # an iterator of pairs is consumed once, here
    params, current, layout, hf_config, family, current_version = _phase(
        "target", lambda: destination(target, config, LoadOptions(tp=tp, ep=ep, pp=pp, pp_layers=pp_layers), rules))
    if not 0 <= src < layout.world:
        raise DistloadError(f"refit: src={src} is not a rank of this job (world {layout.world})")
    new_version, meta = _phase("metadata", lambda: _announce(rank, src, version, tensors))
    highest, minus_lowest = max_over_ranks([current_version, -current_version])   # one all-reduce, at any world
    if highest != -minus_lowest:
        raise RankFailure(f"refit refused: ranks are at different versions, from {-minus_lowest} to {highest} (this "
                          f"rank: {current_version}; one missed an update); reload or refit every rank from one state")
    if new_version is None:
        new_version = current_version + 1

    def make_plan():
        if new_version <= current_version:
            raise DistloadError(f"refit version {new_version} is not newer than the current version {current_version}")
        staging = (staging_mib << 20) if staging_mib else DEFAULT_STAGING_BYTES
        plan = update_plan(meta, hf_config, family, replace(layout, readers=(src,), owner_reads=False), staging,
                            quantize, dequantize, partial)
        if not plan.specs[rank]:
            raise PlanError("refit: the update holds no complete param (every part of a fused param is needed)")
        problems = mismatches(plan, rank, current, params)
        if problems:
            raise PlanError(f"refit refused before any byte moved ({len(problems)} param(s)): " + "; ".join(problems[:8]))
        return plan

    plan = _phase("plan", make_plan)
    live = {n: params[n] for n in plan.specs[rank]}
    device = next(iter(live.values())).device if live else torch.device("cpu")
    # Post-load kernels run on refit too, exactly as on load: quantized plans carry per-rank steps (FP8
    # requantization of fused params, online quantization) that run as their inputs land; the steps' inputs
    # are staged (one layer in flight), their outputs copied into the live params.
    post = PostProcess(plan, rank, device) if any(plan.post) else None
    try:
        into = _phase("allocate", lambda: post.allocate(live)) if post is not None else live
        _, transfer, _ = transfer_phase(plan, rank, into, device, open_reader=lambda: MemoryReader(tensors),
                                        on_bucket_done=post and post.on_bucket_done, phase="refit (transfer)")
        written = transfer.stats.written
        if post is not None:
            written = _phase("postprocess", lambda: post.finish(transfer.stats.written))
        # Each rank's traffic rides on the reconciliation's summaries: no collective of its own.
        stats = transfer.stats
        mine = {"rank": rank, "bytes_sent": stats.bytes_sent, "bytes_received": stats.bytes_received}
        verdict = _phase("reconcile", lambda: reconcile(plan, rank, live, written, strict=True, report_record=mine))
    except Exception as exc:  # a failed rank, a broken link, a failed check: the same state for the caller
        raise RefitFailed(f"refit to version {new_version} failed after bytes started moving; the params are partly "
                          f"updated (undefined) and stay at version {current_version}: refit again or reload before "
                          f"serving. Cause: {exc}") from exc
    # Acknowledged by every rank in the reconcile agreement: the new version is now visible.
    if isinstance(target, LoadResult):
        target.version = new_version
    return Refit(version=new_version, params=verdict.params,
                 report={"version": new_version, "seconds": round(time.perf_counter() - start, 6),
                         "bytes": plan.checkpoint_bytes, "buckets": len(plan.buckets),
                         "per_rank": verdict.rank_reports})


def _announce(rank: int, src: int, version: int | None, tensors: dict):
    """(the update's version or None, its tensors' metadata), broadcast from the source."""
    payload = None
    if rank == src:
        try:
            payload = ("ok", version, _metadata(tensors))
        except Exception as exc:
            payload = ("error", exc, None)
    kind, new_version, meta = broadcast_object(payload, src=src)
    if kind == "error":
        raise new_version
    return new_version, meta


def update_plan(meta: dict, hf_config: dict, family, layout, staging: int, quantize, dequantize, partial: bool):
    """The plan of a load of a checkpoint holding the update's tensors, the source its one reader. The config is
    the serving job's, checked at its load: an update of some layers is not a config that overstates them."""
    index = {n: TensorEntry(n, n, dtype, shape, 0, math.prod(shape) * itemsize(dtype)) for n, (dtype, shape) in meta.items()}
    plan = build_plan(index, hf_config, family, layout, strict=False, staging_bytes=staging,
                      quantization=for_load(hf_config, quantize, dequantize), config_checked=True)
    if plan.unexpected:
        raise PlanError(f"refit refused before any byte moved: the rules ({family.source}) place no param for "
                        f"{names.describe(plan.unexpected)}; send checkpoint (Hugging Face) names")
    if plan.missing and not partial:
        raise PlanError(f"refit refused before any byte moved: the update lacks {len(plan.missing)} tensor(s) "
                        f"{names.describe(plan.missing)}; send them all, or pass partial=True to update only the "
                        f"params whose tensors are all present")
    if plan.incomplete:   # a partial update: a fused param cannot be written from some of its parts
        shown = "; ".join(f"{param} from {names.describe(sent)} without {names.describe(lacking)}"
                          for param, sent, lacking in plan.incomplete[:4])
        raise PlanError(f"refit refused before any byte moved: the update holds only part of {len(plan.incomplete)} "
                        f"fused param(s): {shown}; send all parts of a fused param (or none of them)")
    return replace(plan, missing=())  # with partial=True the params not in this update keep their values
