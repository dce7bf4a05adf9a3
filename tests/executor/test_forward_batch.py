"""``ForwardBatch.build`` packs the same batch whichever way it builds it.

Short batches are packed from Python lists, long ones with tensor ops; both must give the
layout the kernels rely on, checked here against a plain per-token reference on random
mixes of new and continuing sequences.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from executor import forward_batch
from executor.forward_batch import ForwardBatch
from executor.kv.allocator import RESERVED_LOCATION
from executor.kv.manager import Allocation, Extension
from executor.packing import FIELDS as PACKED_FIELDS
from executor.packing import SEQUENCE_FIELDS, GraphLayout, pack_lists

_WIDTH = 97  # request-slot table row length: not a power of two, so a wrong stride shows
seqs = st.one_of(  # any lengths, or one new token per sequence (the decode packing)
    st.lists(st.tuples(st.integers(0, 40), st.integers(1, 30)), min_size=1, max_size=6),
    st.lists(st.tuples(st.integers(0, 40), st.just(1)), min_size=1, max_size=6))
FIELDS = ("input_ids", "positions", "out_cache_loc", "slots", "seq_lens",
          "prefix_lens", "extend_lens", "extend_start", "logits_indices", "table_index")


def _case(spec: list[tuple[int, int]]) -> tuple[list[int], Allocation, list[int]]:
    exts = tuple(Extension(f"s{i}", 10 + 3 * i, prefix, new, prefix == 0)
                 for i, (prefix, new) in enumerate(spec))
    total = sum(new for _, new in spec)
    locs = torch.randperm(1000, generator=torch.Generator().manual_seed(total))[:total] + 1
    tokens = [(7 * j + 3) % 500 for j in range(total)]
    rows = [i for i in range(len(spec)) if i % 2 == 0]
    return tokens, Allocation(exts, locs), rows


@pytest.mark.parametrize("list_max", [0, 10_000], ids=["tensor-path", "list-path"])
# The patched threshold is the same for every example, so sharing the fixture is safe.
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=seqs)
def test_both_build_paths_match_a_per_token_reference(
        monkeypatch: pytest.MonkeyPatch, list_max: int, spec: list[tuple[int, int]]) -> None:
    monkeypatch.setattr(forward_batch, "_LIST_BUILD_MAX_TOKENS", list_max)
    tokens, alloc, rows = _case(spec)
    fb = ForwardBatch.build("prefill", tokens, alloc, rows, torch.device("cpu"), _WIDTH)
    positions, slots, starts, acc = [], [], [], 0
    for e in alloc.extensions:
        starts.append(acc)
        acc += e.new_len
        for j in range(e.new_len):
            positions.append(e.prefix_len + j)
            slots.append(e.slot * _WIDTH + e.prefix_len + j)
    assert fb.input_ids.tolist() == tokens
    assert fb.positions.tolist() == positions
    assert fb.table_index.tolist() == slots
    assert fb.out_cache_loc.tolist() == alloc.out_cache_loc.tolist()
    assert fb.extend_start.tolist() == starts
    assert fb.prefix_lens.tolist() == [e.prefix_len for e in alloc.extensions]
    assert fb.extend_lens.tolist() == [e.new_len for e in alloc.extensions]
    assert fb.seq_lens.tolist() == [e.prefix_len + e.new_len for e in alloc.extensions]
    assert fb.slots.tolist() == [e.slot for e in alloc.extensions]
    assert fb.logits_indices.tolist() == [starts[i] + spec[i][1] - 1 for i in rows]
    assert all(t.dtype == torch.int64 for t in (fb.input_ids, fb.positions, fb.table_index))


_SCRATCH = 10_000  # a table cell past every slot's row, as ReqToTokenTable.scratch_index


@pytest.mark.parametrize("list_max", [0, 10_000], ids=["tensor-path", "list-path"])
@pytest.mark.parametrize("spare", [0, 5])
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=seqs)
def test_a_batch_packed_for_a_bucket_is_the_plain_batch_plus_padding(
        monkeypatch: pytest.MonkeyPatch, list_max: int, spare: int,
        spec: list[tuple[int, int]]) -> None:
    """Every field reads the same as the plain batch; the padding tokens up to the bucket
    are token 0 at position 0 writing KV location 0 and the table's scratch cell, at the
    fixed offsets a captured prologue reads; everything lives in the layout's buffer."""
    monkeypatch.setattr(forward_batch, "_LIST_BUILD_MAX_TOKENS", list_max)
    tokens, alloc, rows = _case(spec)
    cpu = torch.device("cpu")
    plain = ForwardBatch.build("prefill", tokens, alloc, rows, cpu, _WIDTH)
    s = plain.num_tokens + spare
    dest = torch.full((GraphLayout.max_packed_size(s),), -7, dtype=torch.int64)
    fb = ForwardBatch.build("prefill", tokens, alloc, rows, cpu, _WIDTH,
                            layout=GraphLayout(s, _SCRATCH, dest))
    for name in FIELDS:
        assert torch.equal(getattr(fb, name), getattr(plain, name)), name
        assert getattr(fb, name).untyped_storage().data_ptr() == dest.data_ptr(), name
    assert fb.bucket == s and plain.bucket is None and fb.decode_rows is None
    # The sequence fields as one (5, B) block of the transfer (a fixed_grid prefill
    # graph's attention refreshes its static rows with one copy of it).
    want = torch.stack([getattr(plain, name) for name in SEQUENCE_FIELDS])
    for batch in (plain, fb):
        assert batch.sequence_rows is not None and torch.equal(batch.sequence_rows, want)
    assert fb.sequence_rows.untyped_storage().data_ptr() == dest.data_ptr()
    t, layout = plain.num_tokens, GraphLayout(s, _SCRATCH, dest)
    pads = {"input_ids": 0, "positions": 0, "table_index": _SCRATCH,
            "out_cache_loc": RESERVED_LOCATION}
    for name, pad in pads.items():  # the fixed places a captured prologue reads
        region = layout.field(name)
        assert torch.equal(region[:t], getattr(plain, name)), name
        assert region[t:].eq(pad).all(), name


@pytest.mark.parametrize("list_max", [0, 10_000], ids=["tensor-path", "list-path"])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_a_decode_batch_packed_for_a_bucket_carries_pad_rows(
        monkeypatch: pytest.MonkeyPatch, list_max: int, rows: int) -> None:
    """A decode batch's graph rows (location, slot, length) sit at ``[3s, 6s)``; the
    rows past the batch are the Triton backend's padding row, so the copy of the whole
    block the prologue captures is the refresh, padding included."""
    from executor.packing import DECODE_PAD_ROW as _PAD_ROW

    monkeypatch.setattr(forward_batch, "_LIST_BUILD_MAX_TOKENS", list_max)
    exts = tuple(Extension(f"s{i}", 2 + i, 5 + 3 * i, 1, False) for i in range(rows))
    alloc = Allocation(exts, torch.arange(100, 100 + rows))
    cpu, bucket = torch.device("cpu"), 8
    plain = ForwardBatch.build("decode", list(range(rows)), alloc, list(range(rows)), cpu,
                               _WIDTH)
    dest = torch.zeros(GraphLayout.max_packed_size(bucket), dtype=torch.int64)
    layout = GraphLayout(bucket, _SCRATCH, dest, "decode")
    fb = ForwardBatch.build("decode", list(range(rows)), alloc, list(range(rows)), cpu,
                            _WIDTH, layout=layout)
    assert fb.decode_rows is not None and plain.decode_rows is not None
    assert torch.equal(fb.decode_rows, plain.decode_rows)
    # A decode batch carries its decode rows only (the sequence block is a prefill's).
    assert fb.sequence_rows is None and plain.sequence_rows is None
    block = layout.decode_rows
    assert block.data_ptr() == fb.decode_rows.data_ptr()
    assert torch.equal(block[:, :rows], plain.decode_rows)
    assert all(tuple(col) == _PAD_ROW for col in block[:, rows:].t().tolist())
    for name in FIELDS:
        assert torch.equal(getattr(fb, name), getattr(plain, name)), name


def test_a_batch_larger_than_its_bucket_is_refused() -> None:
    tokens, alloc, rows = _case([(0, 9)])
    dest = torch.zeros(GraphLayout.max_packed_size(8), dtype=torch.int64)
    with pytest.raises(ValueError, match="9 tokens do not fit a bucket of 8"):
        ForwardBatch.build("prefill", tokens, alloc, rows, torch.device("cpu"), _WIDTH,
                           layout=GraphLayout(8, _SCRATCH, dest))


def test_max_packed_size_holds_the_largest_batch_of_a_bucket() -> None:
    """One-token sequences, all sampled: the most entries a batch of ``s`` tokens packs."""
    s = 12
    tokens, alloc, _ = _case([(3, 1)] * s)
    dest = torch.zeros(GraphLayout.max_packed_size(s), dtype=torch.int64)
    fb = ForwardBatch.build("prefill", tokens, alloc, list(range(s)), torch.device("cpu"),
                            _WIDTH, layout=GraphLayout(s, _SCRATCH, dest))
    assert fb.logits_indices.tolist() == list(range(s))


def test_fill_padding_writes_a_batch_of_padding_only() -> None:
    """What a prologue's warm-up runs on: the values a packed batch pads with, at the same
    offsets (ids, positions, table index, locations, decode rows)."""
    from executor.packing import DECODE_PAD_ROW as _PAD_ROW

    b = 6
    dest = torch.full((GraphLayout.max_packed_size(b),), -7, dtype=torch.int64)
    layout = GraphLayout(b, _SCRATCH, dest, "decode")
    layout.fill_padding()
    assert layout.field("input_ids").eq(0).all() and layout.field("positions").eq(0).all()
    assert layout.field("table_index").eq(_SCRATCH).all()
    assert all(tuple(col) == _PAD_ROW for col in layout.decode_rows.t().tolist())
    # exactly what packing an empty batch for the bucket writes
    packed = torch.full_like(dest, -7)
    frame = layout.frame
    packed[: frame.total] = torch.frombuffer(
        pack_lists(dict.fromkeys(PACKED_FIELDS, ()), frame, _SCRATCH), dtype=torch.int64)
    assert torch.equal(packed, dest)


def test_a_layout_gives_the_same_views_for_batches_of_the_same_sizes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches of one size packed for a graph bucket share their views of the fixed
    buffer (made once), and each view reads the batch packed last."""
    from executor import packing

    cpu, bucket = torch.device("cpu"), 8
    layout = GraphLayout(bucket, _SCRATCH, torch.zeros(GraphLayout.max_packed_size(bucket),
                                                       dtype=torch.int64), "decode")

    def decode_batch(base: int) -> ForwardBatch:
        exts = tuple(Extension(f"s{i}", 2 + i, base + i, 1, False) for i in range(3))
        alloc = Allocation(exts, torch.arange(100 + base, 103 + base))
        return ForwardBatch.build("decode", [base, base + 1, base + 2], alloc, [0, 1, 2], cpu,
                                  _WIDTH, layout=layout)

    first, second = decode_batch(5), decode_batch(40)
    assert first.input_ids is second.input_ids and first.decode_rows is second.decode_rows
    assert second.input_ids.tolist() == [40, 41, 42]
    assert second.positions.tolist() == [40, 41, 42]
    assert second.seq_lens.tolist() == [41, 42, 43]
    assert second.out_cache_loc.tolist() == [140, 141, 142]
    plain = ForwardBatch.build("decode", [40, 41, 42], Allocation(
        tuple(Extension(f"s{i}", 2 + i, 40 + i, 1, False) for i in range(3)),
        torch.arange(140, 143)), [0, 1, 2], cpu, _WIDTH)
    for name in FIELDS:
        assert torch.equal(getattr(second, name), getattr(plain, name)), name
    monkeypatch.setattr(packing, "_VIEWS_KEPT", 1)  # a full cache starts over
    third = ForwardBatch.build("decode", [1], Allocation(
        (Extension("s0", 2, 9, 1, False),), torch.arange(7, 8)), [0], cpu, _WIDTH,
        layout=layout)
    assert third.input_ids.tolist() == [1] and len(layout._views) == 1


@pytest.mark.parametrize("bucket", [None, 24])
@pytest.mark.parametrize("rows", [1, 5, 20])
def test_numpy_decode_packing_equals_the_list_packing(
        monkeypatch: pytest.MonkeyPatch, bucket: int | None, rows: int) -> None:
    """A decode batch packed with numpy (large batches) is the list-packed batch, entry for
    entry (padding too) and host tuple for tuple, from extensions or from columns."""
    from executor.kv.manager import Columns

    cpu = torch.device("cpu")
    slots, prefix = [7 * i % 23 for i in range(rows)], [3 + 5 * i for i in range(rows)]
    tokens = [(-1 if i % 3 else 11 * i) for i in range(rows)]
    logits = list(range(rows))[::2]
    from_exts = Allocation(tuple(Extension(f"s{i}", s, p, 1, False) for i, (s, p) in
                                 enumerate(zip(slots, prefix, strict=True))),
                           torch.arange(50, 50 + rows))
    from_cols = Allocation.of_columns(Columns(tuple(f"s{i}" for i in range(rows)), slots,
                                              prefix, [1] * rows, [False] * rows),
                                      torch.arange(50, 50 + rows))

    def build(numpy_min: int, alloc: Allocation) -> ForwardBatch:
        monkeypatch.setattr(forward_batch, "_NUMPY_MIN_ROWS", numpy_min)
        layout = None if bucket is None else GraphLayout(
            bucket, _SCRATCH, torch.full((GraphLayout.max_packed_size(bucket),), -7,
                                         dtype=torch.int64), "decode")
        return ForwardBatch.build("decode", tokens, alloc, logits, cpu, _WIDTH, layout=layout)

    want = build(10_000, from_exts)
    for got in (build(0, from_exts), build(0, from_cols)):
        assert got.packed is not None and want.packed is not None
        assert torch.equal(got.packed, want.packed) and got.sizes == want.sizes
        for name in FIELDS:
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert (got.slots_host, got.seq_lens_host, got.prefix_lens_host,
                got.extend_lens_host) == (want.slots_host, want.seq_lens_host,
                                          want.prefix_lens_host, want.extend_lens_host)
        assert all(type(v) is int for v in got.seq_lens_host + got.slots_host)


HOSTS = ("slots_host", "seq_lens_host", "prefix_lens_host", "extend_lens_host")


@settings(max_examples=30, deadline=None)
@given(spec=seqs, spare=st.integers(0, 5), padded=st.booleans())
def test_another_rank_rebuilds_the_batch_from_what_the_hook_was_given(
        spec: list[tuple[int, int]], spare: int, padded: bool) -> None:
    """``before_transfer`` gets the packed host buffer and sizes before the device copy
    (what rank 0 sends); ``from_packed`` of them on another rank gives the same fields and
    host tuples, plain or packed for a bucket (decode batches with padded rows too)."""
    tokens, alloc, rows = _case(spec)
    decode = all(new == 1 for _, new in spec)
    phase = "decode" if decode else "prefill"
    cpu = torch.device("cpu")
    bucket = len(tokens) + spare

    def layout() -> GraphLayout | None:
        if not padded:
            return None
        dest = torch.full((GraphLayout.max_packed_size(bucket),), -7, dtype=torch.int64)
        return GraphLayout(bucket, _SCRATCH, dest, phase)

    sent: list[tuple[torch.Tensor, object]] = []
    fb = ForwardBatch.build(phase, tokens, alloc, rows, cpu, _WIDTH, layout=layout(),
                            before_transfer=lambda flat, sizes: sent.append(
                                (flat.clone(), sizes)))
    assert len(sent) == 1
    flat, sizes = sent[0]
    assert torch.equal(flat, fb.packed) and sizes == fb.sizes
    other = ForwardBatch.from_packed(phase, flat, fb.sizes, cpu, layout=layout())
    for name in (*FIELDS, *HOSTS, "bucket"):
        a, b = getattr(fb, name), getattr(other, name)
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, name
    assert (fb.decode_rows is None) == (other.decode_rows is None)
    if fb.decode_rows is not None:
        assert torch.equal(fb.decode_rows, other.decode_rows)
