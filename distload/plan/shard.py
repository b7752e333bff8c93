"""Pure shard math: a style + part sizes + (group size p, rank r) -> the regions rank r holds.

No I/O, no process group: every rule is testable in microseconds. Every tensor is seen through its
2-D view [prod(shape[:-1]), shape[-1]] (1-D [n] as [n, 1]), so every style is a set of rectangles:
rows of dim 0 (`column`, `vocab`, `merged`, `qkv`) or columns of the last dim (`row`).

    style      rank r of p holds                                  (DESIGN §4.1)
    replicate  the whole tensor (several parts: concatenated in part order, merged but not split)
    rank0      the whole tensor on rank 0, zeros elsewhere (a bias the group sums, added once)
    column     rows [r*n/p, (r+1)*n/p)
    row        columns [r*n/p, (r+1)*n/p)
    vocab      rows of block r after zero-padding n to a multiple of lcm(pad_to, p)
    merged     each part cut like column, concatenated in part order
    qkv        q by heads (H/p each); k, v by kv heads, or kv head r // (p/Hkv) when p > Hkv
    kv         one tensor of Hkv equal head blocks (a k norm over the whole projection), cut like k above
    qkv_grouped  one fused tensor packed per kv head (InternLM2 wqkv: per kv head its H/Hkv q heads, then
               k, then v); rank r holds its kv groups whole, or when p > Hkv one group's share of q heads
               and the group's k and v (replicated), keeping the packed order

    qkv_packed the same packed source cut into qkv's layout cat[q_r, k_r, v_r] (what vLLM serves for InternLM2)

column, row and merged take `groups` (rule key: a number of heads): p must divide it, so a rank never holds
part of a head even where the rows would divide (DeepSeek MLA's q_b_proj / kv_b_proj, Qwen3-Next's groups).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from ..errors import PlanError


class Part(NamedTuple):
    """A logical part: rows [row0, row0 + rows) of a source tensor's 2-D view (a fused source has several)."""
    source: str
    row0: int
    rows: int
    cols: int


class Piece(NamedTuple):
    """Copy source rows x cols (2-D view) to the destination's 2-D view at (dst_row, dst_col). (Tuples, like
    ranks.Ranks: a MoE plan makes one per expert source and rank of its expert group, hundreds of thousands.)"""
    source: str
    rows: tuple[int, int]
    cols: tuple[int, int]
    dst_row: int
    dst_col: int

    @property
    def numel(self) -> int:
        return (self.rows[1] - self.rows[0]) * (self.cols[1] - self.cols[0])


class LocalLayout(NamedTuple):
    """What one rank holds of one param: its 2-D size, the pieces that fill it, and zero padding."""
    rows: int
    cols: int
    pieces: tuple[Piece, ...]
    padding: tuple[tuple[int, int, int, int], ...] = ()   # (row0, row1, col0, col1) regions left zero


def view2d(shape: tuple[int, ...]) -> tuple[int, int]:
    """The 2-D view every style works on: [prod(shape[:-1]), shape[-1]]; 1-D [n] -> [n, 1]."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return shape[0], 1
    return math.prod(shape[:-1]), shape[-1]


def valid_group_sizes(ok, upto: int = 64) -> list[int]:
    """The group sizes in 1..upto that satisfy `ok`, for 'try tp ...' hints."""
    return [p for p in range(1, upto + 1) if ok(p)]


def _divides_hint(n: int, what: str, label: str, p: int, dim_desc: str) -> PlanError:
    sizes = valid_group_sizes(lambda q: n % q == 0, upto=max(8, min(n, 64)))
    return PlanError(f"{what}: {dim_desc}={n}, {label}={p}: {label} must divide {n} "
                     f"(try {label} {', '.join(map(str, sizes))})")


def _rows_block(part: Part, p: int, r: int, what: str, label: str) -> tuple[int, int]:
    if part.rows % p:
        raise _divides_hint(part.rows, what, label, p, f"rows of {part.source}")
    n = part.rows // p
    return part.row0 + r * n, part.row0 + (r + 1) * n


def _whole(part: Part, dst_row: int = 0) -> Piece:
    return Piece(part.source, (part.row0, part.row0 + part.rows), (0, part.cols), dst_row, 0)


def _stack_rows(blocks: list[tuple[Part, tuple[int, int]]]) -> LocalLayout:
    pieces, dst = [], 0
    for part, (a, b) in blocks:
        pieces.append(Piece(part.source, (a, b), (0, part.cols), dst, 0))
        dst += b - a
    return LocalLayout(rows=dst, cols=blocks[0][0].cols, pieces=tuple(pieces))


def cut_replicate(parts, p, r, what, label="tp", **_) -> LocalLayout:
    """The whole tensor; several parts (DeepSeek MLA's fused_qkv_a_proj): concatenated, merged but not split."""
    return _stack_rows([(part, (part.row0, part.row0 + part.rows)) for part in parts])


def _check_groups(groups: int | None, p: int, what: str, label: str) -> None:
    """A cut that must keep whole heads (rule key `groups`): p divides their number."""
    if groups is not None and groups % p:
        sizes = valid_group_sizes(lambda q: groups % q == 0, upto=max(8, min(groups, 64)))
        raise PlanError(f"{what}: {groups} heads (rule groups), {label}={p}: {label} must divide {groups} so that "
                        f"each rank holds whole heads (try {label} {', '.join(map(str, sizes))})")


def cut_column(parts, p, r, what, label="tp", groups=None, **_) -> LocalLayout:
    (part,) = parts
    _check_groups(groups, p, what, label)
    return _stack_rows([(part, _rows_block(part, p, r, what, label))])


def cut_merged(parts, p, r, what, label="tp", groups=None, **_) -> LocalLayout:
    _check_groups(groups, p, what, label)
    return _stack_rows([(part, _rows_block(part, p, r, what, label)) for part in parts])


def cut_row(parts, p, r, what, label="tp", groups=None, **_) -> LocalLayout:
    (part,) = parts
    _check_groups(groups, p, what, label)
    if part.cols % p:
        raise _divides_hint(part.cols, what, label, p, f"columns of {part.source}")
    n = part.cols // p
    piece = Piece(part.source, (part.row0, part.row0 + part.rows), (r * n, (r + 1) * n), 0, 0)
    return LocalLayout(part.rows, n, (piece,))


def padded_vocab(vocab: int, p: int, pad_to: int) -> int:
    multiple = math.lcm(pad_to, p)
    return -(-vocab // multiple) * multiple


def cut_vocab(parts, p, r, what, label="tp", pad_to=64, **_) -> LocalLayout:
    (part,) = parts
    block = padded_vocab(part.rows, p, pad_to) // p
    start, stop = r * block, (r + 1) * block
    real_stop = min(stop, part.rows)
    pieces = ()
    if real_stop > start:
        pieces = (Piece(part.source, (part.row0 + start, part.row0 + real_stop), (0, part.cols), 0, 0),)
    first_pad = max(real_stop, start) - start
    padding = ((first_pad, block, 0, part.cols),) if first_pad < block else ()
    return LocalLayout(block, part.cols, pieces, padding)


def qkv_valid(heads: int, kv_heads: int, p: int) -> bool:
    return heads % p == 0 and (kv_heads % p == 0 or p % kv_heads == 0)


def cut_qkv(parts, p, r, what, label="tp", heads=None, kv_heads=None, **_) -> LocalLayout:
    q, k, v = parts
    _check_heads(heads, kv_heads, p, what, label)
    head_dim = q.rows // heads
    q_rows = (q.row0 + r * (heads // p) * head_dim, q.row0 + (r + 1) * (heads // p) * head_dim)
    first, count = _kv_span(kv_heads, p, r)   # past p = Hkv: kv head r // (p / Hkv), replicated
    k_rows = (k.row0 + first * head_dim, k.row0 + (first + count) * head_dim)
    v_rows = (v.row0 + first * head_dim, v.row0 + (first + count) * head_dim)
    return _stack_rows([(q, q_rows), (k, k_rows), (v, v_rows)])


def _kv_span(kv_heads: int, p: int, r: int) -> tuple[int, int]:
    """(first kv head, count) of rank r: kv heads split p ways, or head r // (p / Hkv) replicated."""
    if p <= kv_heads:
        return r * (kv_heads // p), kv_heads // p
    return r // (p // kv_heads), 1


def _check_heads(heads: int, kv_heads: int, p: int, what: str, label: str) -> None:
    if not qkv_valid(heads, kv_heads, p):
        sizes = valid_group_sizes(lambda x: qkv_valid(heads, kv_heads, x), upto=max(8, min(64, 2 * heads)))
        raise PlanError(f"{what}: num_attention_heads={heads}, num_key_value_heads={kv_heads}, {label}={p}: "
                        f"{label} must divide {heads} and divide {kv_heads} or be a multiple of it "
                        f"(try {label} {', '.join(map(str, sizes))})")


def _head_rows(part: Part, count: int, what: str) -> int:
    if part.rows % count:
        raise PlanError(f"{what}: {part.source} has {part.rows} rows, not a whole number per head of {count} heads")
    return part.rows // count


def cut_kv(parts, p, r, what, label="tp", heads=None, kv_heads=None, **_) -> LocalLayout:
    (part,) = parts
    _check_heads(heads, kv_heads, p, what, label)
    per_head = _head_rows(part, kv_heads, what)
    first, count = _kv_span(kv_heads, p, r)
    return _stack_rows([(part, (part.row0 + first * per_head, part.row0 + (first + count) * per_head))])


def cut_qkv_grouped(parts, p, r, what, label="tp", heads=None, kv_heads=None, **_) -> LocalLayout:
    (part,) = parts
    _check_heads(heads, kv_heads, p, what, label)
    q_per_group = heads // kv_heads
    head_rows = _head_rows(part, kv_heads * (q_per_group + 2), what)
    group_rows = (q_per_group + 2) * head_rows
    first, count = _kv_span(kv_heads, p, r)
    base = part.row0 + first * group_rows
    if p <= kv_heads:  # whole groups, contiguous on disk
        return _stack_rows([(part, (base, base + count * group_rows))])
    share = heads // p                                  # q heads of this rank inside its group
    j = r % (p // kv_heads)
    q0 = base + j * share * head_rows
    kv0 = base + q_per_group * head_rows
    return _stack_rows([(part, (q0, q0 + share * head_rows)), (part, (kv0, kv0 + 2 * head_rows))])


def transpose_layout(lay: LocalLayout, matrices: dict[str, tuple[int, int]], dst_matrix_rows: int) -> LocalLayout:
    """A layout cut in serving orientation, seen in stored orientation (sources with their last two axes swapped).

    `lay` stacks K local matrices of `dst_matrix_rows` rows each (K = 1, or one per hosted expert); matrices[src]
    = (rows, cols) of one serving-orientation matrix of src (a stacked source holds several). Each piece becomes
    the same rectangle in the stored source, landing in the transposed local matrices: [K * cols, dst_matrix_rows].
    """
    pieces = []
    for pc in lay.pieces:
        rows, cols = matrices[pc.source]
        m = pc.rows[0] // rows
        if pc.rows[1] > (m + 1) * rows:
            raise PlanError(f"{pc.source}: a piece spans two stacked matrices; a transposed cut stays in one")
        k, x = divmod(pc.dst_row, dst_matrix_rows)
        pieces.append(Piece(pc.source, (m * cols + pc.cols[0], m * cols + pc.cols[1]),
                            (pc.rows[0] - m * rows, pc.rows[1] - m * rows), k * lay.cols + pc.dst_col, x))
    padding = []
    for r0, r1, c0, c1 in lay.padding:  # zero regions move the same way (each inside one matrix)
        k = r0 // dst_matrix_rows
        padding.append((k * lay.cols + c0, k * lay.cols + c1, r0 - k * dst_matrix_rows, r1 - k * dst_matrix_rows))
    return LocalLayout(rows=(lay.rows // dst_matrix_rows) * lay.cols if dst_matrix_rows else 0,
                       cols=dst_matrix_rows, pieces=tuple(pieces), padding=tuple(padding))


def cut_rank0(parts, p, r, what, label="tp", **_) -> LocalLayout:
    """The whole tensor on rank 0 of the group, zeros on the others: a row layer's bias that the group sums
    (vLLM's GPT-OSS w2_bias under TP: added once, by rank 0)."""
    (part,) = parts
    if r == 0:
        return LocalLayout(part.rows, part.cols, (_whole(part),))
    return LocalLayout(part.rows, part.cols, (), ((0, part.rows, 0, part.cols),))


def _merged_runs(part: Part, starts: list[int], size: int) -> list[tuple[Part, tuple[int, int]]]:
    """Row ranges [start, start + size) of `part`, neighbours merged: one piece per contiguous run."""
    runs: list[list[int]] = []
    for a in starts:
        if runs and runs[-1][1] == a:
            runs[-1][1] = a + size
        else:
            runs.append([a, a + size])
    return [(part, (part.row0 + a, part.row0 + b)) for a, b in runs]


def cut_qkv_packed(parts, p, r, what, label="tp", heads=None, kv_heads=None, **_) -> LocalLayout:
    """One fused source packed per kv-head group (InternLM2 wqkv), cut into the plain qkv layout
    cat[q_r, k_r, v_r] that vLLM serves (it unpacks the groups while loading)."""
    (part,) = parts
    _check_heads(heads, kv_heads, p, what, label)
    q_per_group = heads // kv_heads
    hd = _head_rows(part, kv_heads * (q_per_group + 2), what)
    group = (q_per_group + 2) * hd
    q_heads = range(r * (heads // p), (r + 1) * (heads // p))
    first, count = _kv_span(kv_heads, p, r)
    q = [(h // q_per_group) * group + (h % q_per_group) * hd for h in q_heads]
    k = [g * group + q_per_group * hd for g in range(first, first + count)]
    v = [a + hd for a in k]
    return _stack_rows(_merged_runs(part, q, hd) + _merged_runs(part, k, hd) + _merged_runs(part, v, hd))


CUTS = {
    "replicate": cut_replicate,
    "rank0": cut_rank0,
    "column": cut_column,
    "row": cut_row,
    "vocab": cut_vocab,
    "merged": cut_merged,
    "qkv": cut_qkv,
    "kv": cut_kv,
    "qkv_grouped": cut_qkv_grouped,
    "qkv_packed": cut_qkv_packed,
}
HEAD_STYLES = ("qkv", "kv", "qkv_grouped", "qkv_packed")   # the cuts that need heads and kv_heads from config.json


def cut(style: str, parts: list[Part], p: int, r: int, what: str, label: str = "tp", **sizes) -> LocalLayout:
    """The local layout of rank r (of p) for one param; PlanError names `what`, the numbers and the fix."""
    return CUTS[style](parts, p, r, what, label=label, **sizes)
