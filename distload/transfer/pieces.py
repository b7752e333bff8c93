"""Copying pieces: out of a read buffer, a shared slot or a received message into this rank's params
(recording each rectangle written), and the messages a reader builds for the wire."""

from __future__ import annotations

import torch

from ..dtypes import torch_dtype
from ..plan import Bucket, Item, LoadPlan, Source, broadcast_offset, clip
from ..plan.wire import PACKED, WireOp
from .buffers import TransferStats, piece_bytes, typed2d, write_piece


def source_block(buf: torch.Tensor, base: int, src: Source, chunk_row0: int, piece) -> torch.Tensor:
    """Bytes of `piece` (rows absolute in the source) inside a buffer holding rows from chunk_row0 at base."""
    start = base + (piece.rows[0] - chunk_row0) * src.row_bytes
    stop = base + (piece.rows[1] - chunk_row0) * src.row_bytes
    isz = torch_dtype(src.dtype).itemsize
    block = buf[start:stop].view(piece.rows[1] - piece.rows[0], src.row_bytes)
    return block[:, piece.cols[0] * isz:piece.cols[1] * isz]


def item_block(plan: LoadPlan, staged: torch.Tensor, bucket: Bucket, item: Item) -> torch.Tensor:
    """An item's bytes inside the reader's buffer of the bucket (its chunks end to end, as read)."""
    src = plan.sources[item.chunk.source]
    base = broadcast_offset(plan, bucket, item.chunk)  # the chunk's place in the read buffer
    return source_block(staged, base, src, item.chunk.rows[0], item.piece)


def landing_region(params: dict[str, torch.Tensor], param: str, piece, src_dtype: str,
                   device: torch.device) -> torch.Tensor | None:
    """The piece's region of the param as flat bytes, if bytes can land there as they are."""
    dst = params.get(param)
    if dst is None:  # allocated on its first write (postprocess.py: staging of a post-load step)
        return None
    if dst.dtype != torch_dtype(src_dtype) or dst.device != device:
        return None
    region = piece_bytes(dst, piece)
    return region.reshape(-1) if region.is_contiguous() else None


def message(plan: LoadPlan, staged: torch.Tensor, spare: torch.Tensor, bucket: Bucket,
            op: WireOp) -> tuple[torch.Tensor, int]:
    """The buffer a reader sends for one packed or direct op, and how many bytes of `spare` (send buffer
    space) it used: a direct piece that is one byte range of the read buffer goes from there itself."""
    if op.carries == PACKED:
        out = spare[:op.nbytes]
        for item, offset in op.packed:
            block = item_block(plan, staged, bucket, item)
            out[offset:offset + item.nbytes].view(block.shape).copy_(block)
        return out, op.nbytes
    block = item_block(plan, staged, bucket, op.item)
    if block.is_contiguous():
        return block.reshape(-1), 0
    out = spare[:op.nbytes]
    out.view(block.shape).copy_(block)
    return out, op.nbytes


class ParamWriter:
    """Writes pieces into one rank's params and records each rectangle in its stats."""

    def __init__(self, plan: LoadPlan, rank: int, params: dict[str, torch.Tensor], stats: TransferStats):
        self.plan, self.rank, self.params, self.stats = plan, rank, params, stats

    def write(self, param: str, piece, block_bytes: torch.Tensor, src_dtype: str) -> None:
        """Copy a block (uint8 [rows, cols*itemsize]) into the param's region; record the rectangle."""
        write_piece(self.params[param], piece, block_bytes, torch_dtype(src_dtype))
        self.stats.record(param, piece)

    def unpack_wire_item(self, block: torch.Tensor, item: Item) -> None:
        """Copy one received (contiguous) item into its param."""
        src = self.plan.sources[item.chunk.source]
        isz = torch_dtype(src.dtype).itemsize
        rows = item.piece.rows[1] - item.piece.rows[0]
        block = block.view(rows, -1) if rows else block[:0].view(0, 0)
        if block.shape[1] != (item.piece.cols[1] - item.piece.cols[0]) * isz:
            raise RuntimeError(f"wire item for {item.param} has {block.shape[1]} bytes per row, plan says "
                               f"{(item.piece.cols[1] - item.piece.cols[0]) * isz}")
        self.write(item.param, item.piece, block, src.dtype)

    def unpack_broadcast(self, buf: torch.Tensor, items: list[Item]) -> None:
        for item in items:
            src = self.plan.sources[item.chunk.source]
            block = source_block(buf, item.offset, src, item.chunk.rows[0], item.piece)
            self.write(item.param, item.piece, block, src.dtype)

    def from_read_buffer(self, staged: torch.Tensor, bucket: Bucket, items: list[Item]) -> None:
        """`items` of a bucket, copied out of a buffer laid out as the reader read it (a reader's shared slot)."""
        for item in items:
            src = self.plan.sources[item.chunk.source]
            self.write(item.param, item.piece, item_block(self.plan, staged, bucket, item), src.dtype)

    def own_share(self, host: torch.Tensor, bucket: Bucket, read_direct: list) -> None:
        """The reader's own share: already in its params (read straight there), or copied from the read buffer."""
        at = 0
        direct = {id(d) for d in read_direct}
        for chunk in bucket.chunks:
            src = self.plan.sources[chunk.source]
            for d in src.shares:
                if self.rank not in d.ranks:
                    continue
                piece = clip(d.piece, chunk.rows)
                if piece is None:
                    continue
                if id(d) in direct:
                    self.stats.record(d.param, piece)
                else:
                    self.write(d.param, piece, source_block(host, at, src, chunk.rows[0], piece), src.dtype)
            at += (chunk.rows[1] - chunk.rows[0]) * src.row_bytes


def zero_padding(params: dict[str, torch.Tensor], specs, stats: TransferStats) -> None:
    """Zero the padded regions (e.g. vocab rows beyond the real vocab) and record them as written."""
    for name, spec in specs.items():
        if spec.alias_of or not spec.padding:
            continue
        for r0, r1, c0, c1 in spec.padding:
            typed2d(params[name])[r0:r1, c0:c1].zero_()
            stats.written.setdefault(name, []).append((r0, r1, c0, c1))
