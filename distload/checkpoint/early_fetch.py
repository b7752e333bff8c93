"""Ask storage for the start of the checkpoint while the ranks start up and plan (one node only).

Between rank 0 parsing the headers and the first rank reading a weight, a load spends tens of
milliseconds on work that touches no weight byte: waiting at the rendezvous for ranks still starting up
(under torchrun), broadcasting the index, planning on every rank and agreeing on the plan, allocating
params, handing out descriptors. Cold, the storage sits idle all that time, and on a node that is bound by
storage (4 ranks on this VM's disk) that idle time is most of what distload costs over every-rank-reads.
So rank 0 reads the headers before the rendezvous (loader.py) and, as soon as it knows where the tensors
are, names the first bytes the node will read to the kernel (`posix_fadvise(WILLNEED)`: the fetch runs
while the ranks gather and plan) in the shape the ranks will read them: each of the first tensors in
`streams` parts, like a TP split, so several requests are in flight at once (one stream leaves this disk
half idle).

Only on one node: there every byte of each tensor the load uses is read on this node, so fetching some
early changes when it is read, not how often. With readers on several nodes each reads only its node's
rows, and a fetch here would read another node's rows from storage too. Not with O_DIRECT (it bypasses the
page cache the fetch fills) and not for torch.load files (unpickled whole, no byte ranges).

Measured (4 ranks, 1 GiB Llama, evicted; a harness alternating loads with and without it and
every-rank-reads in one torchrun session, 15-30 reps each; the ratio of the median paired times): 128 MiB
0.98, 0.96, 0.96, 1.01, 0.99, 0.97; 64 MiB 0.97, 0.93; 96 MiB 0.95; 256 MiB 0.95, 1.01. The disk was busy
for 0.91 of the load with it, 0.87 without (every-rank-reads: 0.93-0.94). A fresh `torchrun -m distload load`
(4 ranks) waited ~180 ms in planning for the ranks' start-up: 1.07 s -> 0.99 s median (6 alternating runs);
with the headers read before the rendezvous as well (after gc_freeze.py): 0.85 s -> 0.82 s (7 alternating runs).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading

from distload.errors import DistloadError

from .file_reads import advise_willneed, willneed_piece

log = logging.getLogger("distload")

# How much of the checkpoint to ask for: about what this disk delivers during the set-up it overlaps
# (~40-60 ms at 1.5 GB/s here), with room for faster storage and longer plans. 96 and 256 MiB measured alike.
EARLY_FETCH_BYTES = 128 << 20
# Parts per tensor when the node has fewer ranks than this: a lone reader is still several streams.
MIN_STREAMS = 4
# A tensor smaller than this per part is asked for whole, by one stream.
MIN_PART_BYTES = 1 << 20


def early_fetch_ranges(tensors, files: tuple[str, ...], streams: int, budget: int) -> list[tuple[str, int, int]]:
    """(file, offset, nbytes) to fetch, in the order to ask for them: the first tensors in file order, each
    split into `streams` parts (as many ranks of a TP split read them), each stream taking at most
    budget / streams bytes from the front of its parts; the streams' ranges interleaved so that every
    stream's head is asked for first. tensors: TensorEntry-like (name, file, offset, nbytes)."""
    streams = max(1, streams)
    rank_of = {f: i for i, f in enumerate(files)}
    ordered = sorted((t for t in tensors if t.nbytes > 0 and t.file in rank_of),
                     key=lambda t: (rank_of[t.file], t.offset))
    left = [budget // streams] * streams
    per_stream: list[list[tuple[str, int, int]]] = [[] for _ in range(streams)]
    for t in ordered:
        if not any(left):
            break
        if t.nbytes >= streams * MIN_PART_BYTES:
            part = -(-t.nbytes // streams)
            parts = [(q, t.offset + q * part, min(part, t.nbytes - q * part)) for q in range(streams)]
        else:  # small: whole, by the stream with the most left
            parts = [(max(range(streams), key=lambda q: left[q]), t.offset, t.nbytes)]
        for q, offset, nbytes in parts:
            take = min(nbytes, left[q])
            if take > 0:
                per_stream[q].append((t.file, offset, take))
                left[q] -= take
    return [r for group in itertools.zip_longest(*per_stream) for r in group if r is not None]


class EarlyFetch:
    """Asks the kernel for `ranges` of files under `root` on a helper thread (the asking itself allocates
    page-cache pages and queues the reads: a few milliseconds this rank's planning need not wait for).
    Only ever a hint: a failure is logged and the load reads those bytes itself. `close()` waits for it."""

    def __init__(self, root: str, ranges: list[tuple[str, int, int]]):
        self.root, self.ranges = root, ranges
        self.asked_bytes = 0  # how much was asked for so far (the report's early_fetch_bytes)
        self._thread = threading.Thread(target=self._run, daemon=True, name="distload-early-fetch")
        self._thread.start()

    def _run(self) -> None:
        opened: dict[str, tuple[int, int]] = {}  # file -> (descriptor, its WILLNEED piece)
        try:
            for rel, offset, nbytes in self.ranges:
                if rel not in opened:
                    fd = os.open(os.path.join(self.root, rel), os.O_RDONLY)
                    opened[rel] = (fd, willneed_piece(fd))
                fd, piece = opened[rel]
                advise_willneed(fd, offset, nbytes, piece)
                self.asked_bytes += nbytes
        except OSError as exc:
            log.debug("early fetch stopped (%s); the load reads those bytes itself", exc)
        finally:
            for fd, _ in opened.values():
                os.close(fd)

    def close(self) -> int:
        """Wait for the asking to finish; returns the bytes asked for."""
        self._thread.join()
        return self.asked_bytes


def start_early_fetch(index, streams: int, budget: int | None = None) -> EarlyFetch | None:
    """An EarlyFetch of the start of a safetensors checkpoint (None for other formats, or a budget of 0:
    DISTLOAD_EARLY_FETCH_MIB=0 turns it off, e.g. to measure what it gains)."""
    if budget is None:
        text = os.environ.get("DISTLOAD_EARLY_FETCH_MIB", str(EARLY_FETCH_BYTES >> 20))
        try:
            budget = int(float(text) * (1 << 20))
        except ValueError:
            raise DistloadError(f"DISTLOAD_EARLY_FETCH_MIB={text!r} is not a number of MiB (0 turns the early "
                                "fetch off)") from None
    if budget <= 0 or index.format != "safetensors" or not hasattr(os, "posix_fadvise"):
        return None
    streams = max(streams, MIN_STREAMS)
    ranges = early_fetch_ranges(index.tensors.values(), index.files, streams, budget)
    if not ranges:
        return None
    log.info("early fetch: asking storage for the first %.0f MiB of the checkpoint (%d streams) while the "
             "ranks start up and plan", sum(n for _, _, n in ranges) / (1 << 20), streams)
    return EarlyFetch(index.root, ranges)
