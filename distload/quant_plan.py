"""Quantized loads in the plan: scales travel with their weights, post-load steps are data (DESIGN §2 4, 6).

No family file names a scale. A quantized checkpoint's linear `X.weight` (fp8) has companions beside
it — `X.weight_scale` and `X.input_scale` (per-tensor FP8: scalars), or `X.weight_scale_inv`
(block FP8: one scale per [bn, bk] block) — so for every target whose parts are `X.weight`, the
companions are the checkpoint's `X.<suffix>` for the suffixes its quantization_config implies (all
parts have them or none: a layer left unquantized, like lm_head, has none). Each companion is cut by a
style derived from its weight's own cut, so every weight style (qkv, merged, fused on disk, expert)
works without a rule of its own:

    per-part   (per-tensor scales, input scales) one scalar per distinct weight source; every rank gets
               all of them in source order: [n_sources], experts [local experts, n_parts]
    block      the weight's pieces mapped onto the block grid: rows [a, b) -> scale rows [a/bn, ceil(b/bn));
               a piece whose edge falls inside a block is refused while planning, with the tp values
               that work (a scale row cannot belong to two ranks' different rows)

`finalize` then turns each rank's *staging* specs (what the transfer writes) into its *final* specs
(what the caller gets, the manifest records and reconciliation checks) plus a list of `Step`s that
postprocess.py runs on the rank as soon as their inputs have arrived:

    checkpoint per-tensor  fused param: requantize each part to the max scale -> one weight_scale;
                           input_scale -> max of the parts (a single-source param keeps its scalars)
    checkpoint block       nothing: weight and weight_scale_inv are final as cut
    --quantize fp8         every linear weight (QUANTIZED_STYLES) -> fp8 + its own weight_scale per rank
    --quantize fp8-block   the same with weight_scale_inv [ceil(n/128), ceil(k/128)] of the local shard
    --dequantize           fp8 weight (+ its scales) -> BF16 weight; the scales are gone
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from . import names
from .errors import PlanError
from .shard import LocalLayout, Piece, view2d

FP8 = "F8_E4M3"
SCALE_DTYPE = "F32"
DEQUANTIZED_DTYPE = "BF16"
HIGH_PRECISION = ("F32", "F16", "BF16")
ONLINE = ("fp8", "fp8-block")
ONLINE_BLOCK = (128, 128)  # DeepSeek-V3's block, what block-FP8 GEMM kernels expect
# Which params online quantization turns into fp8: the linear layers (as vLLM): not embeddings and
# lm_head (vocab), not norms or the MoE router (replicate), never a 1-D bias.
QUANTIZED_STYLES = ("qkv", "merged", "column", "row", "expert")


@dataclass(frozen=True)
class Scheme:
    """What a quantized checkpoint (or --quantize) stores next to each linear weight."""
    name: str                          # "fp8" (per-tensor) or "fp8-block"
    where: str                         # for messages: 'config.json quantization_config (quant_method fp8)'
    weight_scale: str                  # suffix of the weight's scale: weight_scale | weight_scale_inv
    static_input: bool = False         # activation_scheme static: every quantized linear has X.input_scale
    block: tuple[int, int] | None = None

    def describe(self) -> str:
        block = f" {self.block[0]}x{self.block[1]}" if self.block else ""
        return f"{self.name}{block} ({self.where})"


@dataclass(frozen=True)
class Companion:
    """A scale param that travels with its weight target, cut from the weight's own layout."""
    name: str                          # serving name: the weight's name with 'weight' -> the suffix
    weight: str                        # the weight target it belongs to
    role: str                          # "weight" (the weight's scale) or "input" (static activation scale)
    scale_of: tuple[tuple[str, str], ...]   # (weight source, its scale source), in the weight's source order

    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(s for _, s in self.scale_of)


@dataclass(frozen=True)
class Step:
    """One post-load rewrite on one rank; runs once every input has fully arrived.

    op: requantize (fused fp8 weight + per-part scales -> one scale), max (per-part input scales -> one),
    quantize / quantize_block (online), dequantize / dequantize_block. Inputs that are not final params
    are released after the step; outputs replace the params of the same name.
    """
    op: str
    inputs: tuple[str, ...]            # staging params read (the weight first)
    outputs: tuple[str, ...]           # final params written (the weight first, then its scale)
    runs: tuple[tuple[int, int], ...] = ()   # per-tensor: (rows, part) down one local matrix, in row order
    block: tuple[int, int] | None = None


def _spec(*args, **kwargs):
    """A plan.ParamSpec (imported here, not at the top: plan.py imports this module)."""
    from .plan import ParamSpec

    return ParamSpec(*args, **kwargs)


# ----------------------------------------------------------------------------------------------------
# Which scheme


def checkpoint_scheme(config: dict) -> Scheme | None:
    """The checkpoint's FP8 scheme from config.json quantization_config; None when it is not quantized."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    where = f"config.json quantization_config (quant_method {method})"
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise PlanError(f"{where}: fmt {qc.get('fmt')!r} is not supported; distload loads e4m3 FP8 checkpoints")
        static = qc.get("activation_scheme", "dynamic") == "static"
        block = qc.get("weight_block_size")
        if block is None:
            return Scheme("fp8", where, "weight_scale", static)
        return Scheme("fp8-block", where, "weight_scale_inv", static, _block(block, f"{where}: weight_block_size"))
    if method == "compressed-tensors":
        return _compressed_tensors(qc, where)
    raise PlanError(f"{where}: not supported; distload loads quant_method fp8 (per-tensor or weight_block_size) and "
                    f"compressed-tensors FP8 (strategy tensor or block); dequantize the checkpoint first")


def _block(value, where: str) -> tuple[int, int]:
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise PlanError(f"{where} must be two positive integers [rows, cols], got {value!r}; fix config.json")
    return int(value[0]), int(value[1])


def _compressed_tensors(qc: dict, where: str) -> Scheme:
    """compressed-tensors FP8: `weights` of type float, 8 bits, strategy tensor (scalar weight_scale)
    or block (weight_scale on the block grid); static `input_activations` add a scalar input_scale."""
    groups = list((qc.get("config_groups") or {}).items())
    schemes = set()
    for group, body in groups:
        w = (body or {}).get("weights") or {}
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise PlanError(f"{where}: config_groups.{group} quantizes weights to {w.get('num_bits')}-bit "
                            f"{w.get('type')}; distload loads 8-bit float (FP8) compressed-tensors checkpoints only")
        act = (body or {}).get("input_activations")
        static = bool(act) and not act.get("dynamic", False)
        strategy = w.get("strategy")
        if strategy == "tensor":
            schemes.add(Scheme("fp8", where, "weight_scale", static))
        elif strategy == "block":
            block = _block(w.get("block_structure"), f"{where}: config_groups.{group}.weights.block_structure")
            schemes.add(Scheme("fp8-block", where, "weight_scale", static, block))
        else:
            raise PlanError(f"{where}: config_groups.{group} has weight strategy {strategy!r}; distload supports "
                            f"'tensor' and 'block' (a per-channel scale is not cut yet)")
    if len(schemes) != 1:
        raise PlanError(f"{where}: expected one FP8 config group (or several identical ones), got "
                        f"{len(groups)} group(s) describing {len(schemes)} scheme(s)")
    return schemes.pop()


def online_scheme(quantize: str | None) -> Scheme | None:
    if quantize is None:
        return None
    if quantize not in ONLINE:
        raise PlanError(f"--quantize {quantize!r}: choose one of {', '.join(ONLINE)}")
    if quantize == "fp8":
        return Scheme("fp8", "--quantize fp8", "weight_scale")
    return Scheme("fp8-block", "--quantize fp8-block", "weight_scale_inv", block=ONLINE_BLOCK)


# ----------------------------------------------------------------------------------------------------
# Companions: which scale tensors travel with which weight target


def _with_suffix(weight_name: str, suffix: str) -> str:
    return weight_name[: -len("weight")] + suffix


def companions(targets, tensors: dict, scheme: Scheme | None) -> list[Companion]:
    """Scale targets derived from the checkpoint: for each target whose parts are all `X.weight` (and are
    in the checkpoint), its parts' `X.<scale suffix>` and `X.input_scale`, all or none."""
    if scheme is None:
        return []
    out = []
    for t in targets:
        sources = t.sources
        if not t.name.endswith("weight") or not all(s.endswith(".weight") and s in tensors for s in sources):
            continue
        quantized = False
        for suffix, role in ((scheme.weight_scale, "weight"), ("input_scale", "input")):
            scales = [_with_suffix(s, suffix) for s in sources]
            present = [s for s in scales if s in tensors]
            if not present:
                if role == "input" and quantized and scheme.static_input:
                    raise PlanError(f"{t.name}: {scheme.where} says activation_scheme static, but the checkpoint "
                                    f"has no {names.describe(scales)}; re-export the checkpoint with its input "
                                    f"scales or set activation_scheme to dynamic")
                continue
            if len(present) != len(scales):
                raise PlanError(f"{t.name}: the checkpoint has {names.describe(present)} but not "
                                f"{names.describe(sorted(set(scales) - set(present)))}; every part of one param "
                                f"is quantized alike: the checkpoint is incomplete")
            quantized = quantized or role == "weight"
            out.append(Companion(_with_suffix(t.name, suffix), t.name, role, tuple(zip(sources, scales))))
        dtypes = sorted({tensors[s].dtype for s in sources})
        if quantized and dtypes != [FP8]:
            raise PlanError(f"{t.name}: has {scheme.weight_scale} tensors but its weights are {', '.join(dtypes)}; "
                            f"{scheme.where} needs {FP8} weights next to their scales")
        if not quantized and FP8 in dtypes:
            raise PlanError(f"{t.name}: {FP8} weights without {_with_suffix(sources[0], scheme.weight_scale)} "
                            f"({scheme.where}); the checkpoint is missing its scales")
    return out


# ----------------------------------------------------------------------------------------------------
# Companion layouts, derived from the weight's


def companion_layouts(c: Companion, target, weight_specs: list, weight_lays: list[LocalLayout], tensors: dict,
                      scheme: Scheme, group: int, relayout) -> tuple[list, list[LocalLayout]]:
    """Per rank (spec, layout) of companion `c`, from its weight's per-rank specs and layouts.

    group: the size of the group the weight is cut over (tp; for experts, ranks per expert group);
    relayout(q) -> the weight's (specs, layouts) at group size q, called only when a block is split,
    to name the sizes that work.
    """
    if c.role == "weight" and scheme.block:
        return _block_layouts(c, target, weight_specs, weight_lays, tensors, scheme, group, relayout)
    return _per_part_layouts(c, target, weight_specs, tensors)


def _per_part_layouts(c: Companion, target, weight_specs, tensors):
    scale_of = dict(c.scale_of)
    entries = [tensors[s] for s in c.sources]
    not_scalar = [f"{e.name}{list(e.shape)}" for e in entries if math.prod(e.shape) != 1]
    if not_scalar:
        raise PlanError(f"{c.name}: per-tensor scales must hold one value, got {', '.join(not_scalar)}; "
                        f"check quantization_config (a block or channel scheme?)")
    dtypes = sorted({e.dtype for e in entries})
    if len(dtypes) > 1:
        raise PlanError(f"{c.name}: its parts' scales have different dtypes {dtypes}; the checkpoint contradicts itself")
    specs, lays = [], []
    if target.rule.style == "expert":
        if target.rule.stacked:
            raise PlanError(f"{c.name}: per-tensor scales of experts stacked on disk are not supported; "
                            f"use a block-FP8 or per-expert checkpoint")
        n_parts = len(target.expert_sources[0])
        for w in weight_specs:
            shape = (len(w.experts), n_parts) if n_parts > 1 else (len(w.experts),)
            pieces = tuple(Piece(scale_of[s], (0, 1), (0, 1), slot, j)
                           for slot, e in enumerate(w.experts) for j, s in enumerate(target.expert_sources[e]))
            lays.append(LocalLayout(*view2d(shape), pieces))
            glob = (w.global_shape[0], n_parts) if n_parts > 1 else (w.global_shape[0],)
            specs.append(_spec(c.name, "expert", dtypes[0], glob, shape, experts=w.experts))
        return specs, lays
    if len(c.sources) == 1:  # one source (also a fused one on disk): its scalar, as it is, on every rank
        (entry,) = entries
        for _ in weight_specs:
            lays.append(LocalLayout(1, 1, (Piece(entry.name, (0, 1), (0, 1), 0, 0),)))
            specs.append(_spec(c.name, "replicate", entry.dtype, tuple(entry.shape), tuple(entry.shape)))
        return specs, lays
    shape = (len(c.sources),)
    for _ in weight_specs:
        lays.append(LocalLayout(len(c.sources), 1, tuple(Piece(s, (0, 1), (0, 1), i, 0) for i, s in enumerate(c.sources))))
        specs.append(_spec(c.name, "replicate", dtypes[0], shape, shape))
    return specs, lays


class _SplitBlock(Exception):
    """A weight piece whose edge falls inside a block (internal: becomes a PlanError with hints)."""


def _matrix_dims(shape: tuple[int, ...], what: str) -> tuple[int, int]:
    if len(shape) not in (2, 3):
        raise PlanError(f"{what}: block FP8 needs a [N, K] or [experts, N, K] weight, got shape {list(shape)}")
    return shape[-2], shape[-1]


def _block_scale_shape(shape, block) -> tuple[int, ...]:
    *lead, n, k = shape
    return (*lead, -(-n // block[0]), -(-k // block[1]))


def _block_pieces(lay: LocalLayout, spec, scale_of: dict, tensors: dict, block) -> tuple[Piece, ...]:
    """The weight's pieces on the block grid; _SplitBlock when an edge falls inside a block."""
    bn, bk = block
    n_loc, k_loc = _matrix_dims(spec.local_shape, spec.name)
    nb_loc = -(-n_loc // bn)
    out = []
    for pc in lay.pieces:
        n, k = _matrix_dims(tuple(tensors[pc.source].shape), pc.source)
        e, a0 = divmod(pc.rows[0], n)
        a1 = pc.rows[1] - e * n
        slot, d = divmod(pc.dst_row, n_loc)
        if a1 > n:
            raise PlanError(f"{spec.name}: a piece of {pc.source} spans several matrices; block scales cannot follow it")
        (c0, c1), dc = pc.cols, pc.dst_col
        for what, lo, hi, edge, dst, size, b, dst_size in (("row", a0, a1, n, d, a1 - a0, bn, n_loc),
                                                          ("column", c0, c1, k, dc, c1 - c0, bk, k_loc)):
            # A piece starts on a block edge (in the source and in the param) and ends on one, or ends
            # at the source's partial last block exactly where the param's matrix ends.
            if lo % b or dst % b:
                raise _SplitBlock(f"cuts {pc.source} at {what} {lo if lo % b else dst}")
            if hi % b and not (hi == edge and dst + size == dst_size):
                raise _SplitBlock(f"cuts {pc.source} at {what} {hi}")
        nb = -(-n // bn)
        out.append(Piece(scale_of[pc.source], (e * nb + a0 // bn, e * nb + -(-a1 // bn)), (c0 // bk, -(-c1 // bk)),
                         slot * nb_loc + d // bn, dc // bk))
    local = _block_scale_shape(spec.local_shape, block)
    if sum(p.numel for p in out) != math.prod(local):
        raise PlanError(f"{spec.name}: its pieces do not tile the block grid {list(local)} (padded or overlapping "
                        f"shard?); block scales cannot be cut for this param")
    return tuple(out)


def _block_layouts(c: Companion, target, weight_specs, weight_lays, tensors, scheme: Scheme, group: int, relayout):
    block = scheme.block
    scale_of = dict(c.scale_of)
    for w_src, s_src in c.scale_of:
        want = _block_scale_shape(tuple(tensors[w_src].shape), block)
        if tuple(tensors[s_src].shape) != want:
            raise PlanError(f"{s_src}: shape {list(tensors[s_src].shape)}, but {w_src} {list(tensors[w_src].shape)} "
                            f"with block {list(block)} ({scheme.where}) needs {list(want)}; the block size in "
                            f"config.json does not match the checkpoint")
    dtypes = sorted({tensors[s].dtype for s in c.sources})
    if len(dtypes) > 1:
        raise PlanError(f"{c.name}: its parts' scales have different dtypes {dtypes}; the checkpoint contradicts itself")
    try:
        pieces = [_block_pieces(lay, w, scale_of, tensors, block) for lay, w in zip(weight_lays, weight_specs)]
    except _SplitBlock as split:
        raise _split_error(c, target, split, tensors, scheme, group, relayout) from None
    distinct = list(dict.fromkeys(c.sources))
    rows = sum(view2d(tuple(tensors[s].shape))[0] for s in distinct)
    cols = view2d(tuple(tensors[distinct[0]].shape))[1]
    specs, lays = [], []
    for w, ps in zip(weight_specs, pieces):
        local = _block_scale_shape(w.local_shape, block)
        if w.style == "expert":
            glob = (w.global_shape[0],) + _block_scale_shape(w.global_shape[1:], block)
        else:
            glob = (rows, cols)
        lays.append(LocalLayout(*view2d(local), ps))
        specs.append(_spec(c.name, w.style, dtypes[0], glob, local, experts=w.experts))
    return specs, lays


def _split_error(c: Companion, target, split: _SplitBlock, tensors, scheme: Scheme, group: int, relayout) -> PlanError:
    label = "ranks per expert group (world/ep)" if target.rule.style == "expert" else "tp"
    valid = []
    for q in range(1, 65):
        try:
            specs, lays = relayout(q)
            for lay, w in zip(lays, specs):
                _block_pieces(lay, w, dict(c.scale_of), tensors, scheme.block)
        except (_SplitBlock, PlanError):
            continue
        valid.append(q)
    bn, bk = scheme.block
    hint = (f"try {label} {', '.join(map(str, valid))}" if valid else
            "no tp works: a part's size is not a multiple of the block; re-quantize with a block that divides it")
    return PlanError(f"{target.name} (rule {target.rule.style}, block FP8 [{bn}, {bk}] from {scheme.where}): "
                     f"{label}={group} {split}, inside a [{bn}, {bk}] block of its {c.name.rsplit('.', 1)[-1]}; a "
                     f"weight and its block scales are cut together, so every shard edge must fall on a block edge "
                     f"({hint})")


# ----------------------------------------------------------------------------------------------------
# Final specs and post-load steps


def _runs(lay: LocalLayout, spec, part_of: dict) -> tuple[tuple[int, int], ...]:
    """(rows, part) down the first local matrix of a weight, merging neighbours of the same part."""
    n_loc = spec.local_shape[-2] if len(spec.local_shape) == 3 else view2d(spec.local_shape)[0]
    runs: list[list[int]] = []
    for pc in sorted((p for p in lay.pieces if p.dst_row < n_loc), key=lambda p: (p.dst_row, p.dst_col)):
        if pc.dst_col:
            continue  # a row-split piece: its rows are already counted by the piece at column 0
        part = part_of[pc.source]
        if runs and runs[-1][1] == part:
            runs[-1][0] += pc.rows[1] - pc.rows[0]
        else:
            runs.append([pc.rows[1] - pc.rows[0], part])
    if sum(r for r, _ in runs) != n_loc:
        raise PlanError(f"{spec.name}: its pieces do not cover its {n_loc} local rows; cannot requantize per part")
    return tuple((r, p) for r, p in runs)


def _part_of(target) -> dict[str, int]:
    if target.rule.style == "expert" and target.expert_sources:
        return {s: j for parts in target.expert_sources for j, s in enumerate(parts)}
    return {s: i for i, s in enumerate(target.sources)}


def finalize(staging: list[dict], planned: dict, targets: dict, comps: list[Companion], tensors: dict,
             scheme: Scheme | None, quantize: str | None = None,
             dequantize: bool = False) -> tuple[list[dict], list[tuple[Step, ...]], str | None]:
    """(final specs per rank, steps per rank, what the load does about quantization) from the staging specs.

    planned: name -> (per-rank specs, per-rank layouts) of every planned param; targets: name -> Target.
    """
    online = online_scheme(quantize)
    if online and scheme:
        raise PlanError(f"--quantize {quantize}: the checkpoint is already quantized ({scheme.describe()}); "
                        f"drop --quantize")
    if dequantize and online:
        raise PlanError("--quantize and --dequantize contradict each other; pass one")
    if dequantize and not scheme:
        raise PlanError("--dequantize: the checkpoint is not quantized (config.json has no quantization_config); "
                        "drop --dequantize")
    if not online and not scheme:
        return staging, [() for _ in staging], None
    final = [dict(specs) for specs in staging]
    steps: list[list[Step]] = [[] for _ in staging]
    if online:
        _online(final, steps, online)
        return final, [tuple(s) for s in steps], online.describe()
    by_weight: dict[str, dict[str, Companion]] = {}
    for c in comps:
        by_weight.setdefault(c.weight, {})[c.role] = c
    for weight, roles in by_weight.items():
        w_specs, w_lays = planned[weight]
        part_of = _part_of(targets[weight])
        scale, inp = roles.get("weight"), roles.get("input")
        per_part = scale is not None and not scheme.block
        several = _parts(targets[weight]) > 1
        for r, (w, lay) in enumerate(zip(w_specs, w_lays)):
            if w.style == "expert" and not w.experts:
                continue  # this rank hosts no expert: nothing to rewrite
            runs = _runs(lay, w, part_of) if per_part else ()
            if dequantize:
                op = "dequantize_block" if scheme.block else "dequantize"
                inputs = (weight,) + tuple(x.name for x in (scale, inp) if x is not None)
                steps[r].append(Step(op, inputs, (weight,), runs, scheme.block))
                final[r][weight] = replace(w, dtype=DEQUANTIZED_DTYPE)
                for x in (scale, inp):
                    if x is not None:
                        del final[r][x.name]
                continue
            # A param with several weight sources holds one scale per part: fold them into one.
            if per_part and several:
                steps[r].append(Step("requantize", (weight, scale.name), (weight, scale.name), runs))
                final[r][scale.name] = _one_scale_spec(staging[r][scale.name], w, tensors[scale.sources[0]].shape)
            if inp is not None and several:
                steps[r].append(Step("max", (inp.name,), (inp.name,)))
                final[r][inp.name] = _one_scale_spec(staging[r][inp.name], w, tensors[inp.sources[0]].shape)
    for r, specs in enumerate(staging):
        padded = sorted({n for step in steps[r] for n in step.inputs if specs[n].padding})
        if padded:
            raise PlanError(f"{names.describe(padded)}: a post-load step cannot read a zero-padded param")
    return final, [tuple(s) for s in steps], scheme.describe() + (" -> BF16 (--dequantize)" if dequantize else "")


def _parts(target) -> int:
    """Scales per rank-local matrix before folding: one per weight source (per expert: one per part)."""
    if target.rule.style == "expert" and target.expert_sources:
        return len(target.expert_sources[0])
    return len(target.sources)


def _one_scale_spec(staged, weight_spec, scalar_shape):
    """The final spec of a per-part scale folded to one value (per expert for experts)."""
    if weight_spec.style == "expert":
        return replace(staged, dtype=SCALE_DTYPE, global_shape=(weight_spec.global_shape[0],),
                       local_shape=(len(weight_spec.experts),))
    # Every rank holds every part's (global) scale, so the max is the same everywhere: a replicated
    # param, which reconciliation fingerprints across ranks. Its shape is the checkpoint's scalar's.
    return replace(staged, style="replicate", dtype=SCALE_DTYPE, global_shape=tuple(scalar_shape),
                   local_shape=tuple(scalar_shape))


def _online(final: list[dict], steps: list[list[Step]], scheme: Scheme) -> None:
    for r, specs in enumerate(final):
        for name, w in list(specs.items()):
            if (w.alias_of or w.style not in QUANTIZED_STYLES or len(w.local_shape) not in (2, 3)
                    or not name.endswith("weight") or (w.style == "expert") != (len(w.local_shape) == 3)):
                continue
            if w.dtype not in HIGH_PRECISION:
                raise PlanError(f"--quantize {scheme.name}: {name} is {w.dtype}; online quantization reads "
                                f"{', '.join(HIGH_PRECISION)} checkpoints")
            scale = _with_suffix(name, scheme.weight_scale)
            if scale in specs:
                raise PlanError(f"--quantize {scheme.name}: {scale} already exists in the checkpoint's layout")
            if w.padding:
                raise PlanError(f"--quantize {scheme.name}: {name} is zero-padded; it cannot be quantized while loading")
            experts = w.style == "expert"
            if scheme.block:
                local = _block_scale_shape(w.local_shape, scheme.block)
                glob = _block_scale_shape(w.global_shape, scheme.block)
                op = "quantize_block"
            else:  # one scale per rank-local matrix: per expert for experts, else one scalar
                local, glob = ((len(w.experts),), (w.global_shape[0],)) if experts else ((), ())
                op = "quantize"
            specs[scale] = _spec(scale, w.style, SCALE_DTYPE, glob, local, experts=w.experts)
            specs[name] = replace(w, dtype=FP8)
            steps[r].append(Step(op, (name,), (name, scale), block=scheme.block))
