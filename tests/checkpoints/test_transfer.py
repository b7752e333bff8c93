"""distload.transfer.engine without processes (world 1): what the reader asks storage for, and when."""

from __future__ import annotations


from distload.checkpoint import RangeReader, discover
from distload.loader import allocate
from distload.plan import build_plan
from distload.rules import rules_for
from distload.topology import Layout
from distload.transfer import Transfer, zero_padding
from distload.transfer.bucket_reads import PREFETCH_BUCKETS


class RecordingReader(RangeReader):
    """A real RangeReader that also notes, in order, each range it is told to prefetch and each it reads."""

    def __init__(self, root: str):
        super().__init__(root, exact=True)
        self.events: list[tuple[str, str, int, int]] = []

    def prefetch(self, entry_file, offset, nbytes):
        self.events.append(("prefetch", entry_file, offset, nbytes))
        super().prefetch(entry_file, offset, nbytes)

    def read_into(self, entry_file, offset, out, tally=True):
        self.events.append(("read", entry_file, offset, out.numel()))
        return super().read_into(entry_file, offset, out, tally)


def test_reader_asks_for_its_next_buckets_before_reading_them(dense_checkpoints):
    """Every bucket's ranges are named to the reader (prefetch) once, PREFETCH_BUCKETS buckets before it is
    read, and the params still come out exactly as the checkpoint holds them."""
    path = dense_checkpoints["llama"]
    index = discover(path)
    plan = build_plan(index.tensors, index.config, rules_for(index.config), Layout(world=1, tp=1),
                      staging_bytes=64 << 10)
    assert len(plan.buckets) > PREFETCH_BUCKETS + 3
    params = allocate(plan.specs[0], "cpu")
    with RecordingReader(index.root) as reader:
        transfer = Transfer(plan, 0, params, reader=reader)
        transfer.run()
    assert transfer.error is None
    zero_padding(params, plan.staging_specs(0), transfer.stats)  # padded vocab rows, as transfer_phase does
    ranges = [[(plan.sources[c.source].file, plan.sources[c.source].offset + c.rows[0] * plan.sources[c.source].row_bytes,
                (c.rows[1] - c.rows[0]) * plan.sources[c.source].row_bytes) for c in b.chunks] for b in plan.buckets]
    hinted = [e[1:] for e in reader.events if e[0] == "prefetch"]
    assert hinted == [r for rs in ranges for r in rs]  # each bucket's chunks once, in order
    # Bucket k's ranges are named ahead: before anything of bucket k - PREFETCH_BUCKETS (>= 1 back) is read.
    assert PREFETCH_BUCKETS >= 1
    first_read = {}
    for at, e in enumerate(reader.events):
        if e[0] == "read":
            k = next(k for k, rs in enumerate(ranges) if any(f == e[1] and o <= e[2] < o + n for f, o, n in rs))
            first_read.setdefault(k, at)
    for k, rs in enumerate(ranges):
        named = reader.events.index(("prefetch", *rs[0]))
        assert named < first_read[max(0, k - PREFETCH_BUCKETS)], k
    # And the bytes: exactly the serving layout the oracle slices from the checkpoint.
    from checks import differences
    from hf_models import checkpoint_tensors, read_config
    from layout_oracle import serving_shards

    want = serving_shards(checkpoint_tensors(path), read_config(path), 0, 1)
    problems = differences({n: t for n, t in params.items()}, want, "llama tp1")
    assert not problems, "\n".join(problems)
