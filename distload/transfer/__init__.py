"""The only package that moves bytes between ranks (DESIGN §3, §2 step 5).

Readers read byte ranges of the checkpoint into reusable staging buffers (a read-ahead thread keeps
the next bucket coming while this one is on the wire); each bucket goes out as one collective —
`broadcast` when every rank keeps the whole tensor, point-to-point sends otherwise, so a rank receives
only the bytes it keeps — and receivers copy the pieces into their preallocated params. With gloo on CPU,
ranks on a reader's node take their pieces straight out of its shared-memory read buffers instead (only a
token and a reply per bucket travel): sharded bytes never cross a socket within a node. When the whole
job is one node and params are host memory, there are no buckets on the wire at all: every rank copies
its pieces straight from the files its reader opened (node_pull.py, pull.py): one copy per byte.

Everything on the wire is raw bytes in contiguous uint8 buffers: gloo cannot send float8 and silently
corrupts non-contiguous tensors (it sends the storage's first bytes), while `view(torch.uint8)` of a
contiguous buffer is bit-exact. Backend differences (NCCL needs device buffers, gloo host ones) live
here and nowhere else.
"""

from .agreement import LostPeer, agree, agree_on_planning, report_together
from .buffers import TransferStats, as_bytes2d, piece_bytes, typed2d, write_piece
from .collectives import (all_gather_cat, all_gather_objects, all_reduce_sum, barrier, broadcast_object,
                          computed_on_rank0, outcome, shared_from_rank0)
from .engine import Transfer
from .node_pull import NodePulls
from .pieces import zero_padding

__all__ = ["LostPeer", "NodePulls", "Transfer", "TransferStats", "agree", "agree_on_planning", "all_gather_cat", "all_gather_objects",
           "all_reduce_sum", "as_bytes2d", "barrier", "broadcast_object", "computed_on_rank0", "outcome", "report_together", "shared_from_rank0",
           "piece_bytes", "typed2d", "write_piece", "zero_padding"]
