# mypy: allow-untyped-defs
# (``@triton.jit`` parameters stay unannotated: Triton reads annotations as type hints.)
"""One-shot all-reduce kernels over symmetric memory that keep the PDL chain.

``one_shot_all_reduce_kernel`` (the ``flags`` algorithm): each rank copies its share into
its own buffer's slot, flags its arrival in every rank's buffer, spins until every peer's
flag has reached the call's epoch, then sums every rank's share in rank order in float32.
Each rank's buffer (``buffer_bytes``) holds ``FLAG_BYTES`` of arrival flags (int32, one per
(program, rank)), then two data slots that alternate between calls, so one barrier a call
is enough. ``push_all_reduce_kernel`` (the ``push`` algorithm): each rank stores its
share into every peer's buffer, where elements not yet arrived read -0.0, so the data is
its own signal; it also all-gathers, and sums shares a producer already sent
(``push_send``, ``SENT``). Both wait for their predecessor and at once let their
successor launch (PDL). Neither has a timeout: a dead peer hangs the spin, and the rank
heartbeats take the process down. The protocols, step by step, are in ``docs/kernels.md``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from executor.kernels.pdl import pdl_enter

#: Arrival flags at the start of each rank's buffer (MAX_PROGRAMS x world int32 fit).
FLAG_BYTES = 4096
#: Elements per program and iteration, and the most programs a call uses.
BLOCK = 1024
MAX_PROGRAMS = 128
MAX_WORLD = FLAG_BYTES // (4 * MAX_PROGRAMS)


def buffer_bytes(slot_bytes: int) -> int:
    """Bytes of each rank's symmetric buffer for inputs of up to ``slot_bytes``."""
    return FLAG_BYTES + 2 * slot_bytes


def grid_size(numel: int) -> int:
    return max(1, min(triton.cdiv(numel, BLOCK), MAX_PROGRAMS))


@triton.jit
def load_acquire(ptrs):
    return tl.inline_asm_elementwise("ld.acquire.sys.global.b32 $0, [$1];", "=r,l", [ptrs],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def store_release(ptrs, values):
    return tl.inline_asm_elementwise("st.release.sys.global.b32 [$1], $2;\n\tmov.b32 $0, 0;",
                                     "=r,l,r", [ptrs, values], dtype=tl.int32, is_pure=False,
                                     pack=1)


@triton.jit
def one_shot_all_reduce_kernel(
    x_ptr,  # (numel,) this rank's input
    out_ptr,  # (numel,) the sum, written
    bases_ptr,  # (WORLD,) int64: every rank's symmetric buffer address
    counter_ptr,  # (MAX_PROGRAMS,) int32: calls so far, per program
    numel,
    rank,
    slot_bytes,  # bytes per data slot
    WORLD: tl.constexpr,
    FLAGS: tl.constexpr,  # FLAG_BYTES
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)  # the input comes from the previous kernel; the flags are shared
    b = tl.program_id(0)
    stride = tl.num_programs(0) * BLOCK
    elem = x_ptr.dtype.element_ty
    epoch = tl.load(counter_ptr + b) + 1  # wraps after 2**31 calls: compared by difference
    data_off = FLAGS + (epoch & 1).to(tl.int64) * slot_bytes
    # (the buffers and slots are 16-byte aligned: the hints let loads and stores vectorize)
    mine = tl.multiple_of((tl.load(bases_ptr + rank) + data_off).to(tl.pointer_type(elem)), 16)
    for start in range(b * BLOCK, numel, stride):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < numel
        tl.store(mine + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)
    tl.debug_barrier()
    ranks = tl.arange(0, WORLD)
    bases = tl.load(bases_ptr + ranks)  # (WORLD,)
    store_release(bases.to(tl.pointer_type(tl.int32)) + b * WORLD + rank,
                   epoch + ranks * 0)
    flags = tl.load(bases_ptr + rank).to(tl.pointer_type(tl.int32)) + b * WORLD + ranks
    while tl.min(load_acquire(flags) - epoch, axis=0) < 0:
        pass
    tl.debug_barrier()
    for start in range(b * BLOCK, numel, stride):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < numel
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for r in tl.static_range(WORLD):
            theirs = tl.multiple_of((tl.load(bases_ptr + r) + data_off).to(
                tl.pointer_type(elem)), 16)
            acc += tl.load(theirs + offs, mask=mask, other=0.0, cache_modifier=".cv").to(tl.float32)
        tl.store(out_ptr + offs, acc.to(elem), mask=mask)
    tl.store(counter_ptr + b, epoch)


@triton.jit
def _arrived(src, mask):
    """The int16 bits at ``src`` (masked) once none of them reads -0.0: a spin on
    volatile loads, which fetch anew from L2 each round."""
    bits = tl.load(src, mask=mask, other=0, volatile=True)
    while tl.max((bits == _EMPTY).to(tl.int32), axis=0) > 0:
        bits = tl.load(src, mask=mask, other=0, volatile=True)
    return bits


@triton.jit
def _sum_sent(out_ptr, here, counter_ptr, numel, slot_elems, WORLD: tl.constexpr,
              BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """``push_all_reduce_kernel`` under ``SENT``, one block per program (``numel`` at
    most programs x ``BLOCK``: ``sent_fits``). Under PDL this launch starts while the
    producer still runs, and it spins and sums *before* its wait: what it loads is only
    the buffer's regions, where every element is -0.0 until its final value arrives, and
    the lane's counter, last written by this lane's previous launch, which completed
    before the producer passed its own wait (loaded past L1 all the same). Only the
    stores (the sum, the regions marked empty again, the counter) come after the wait, so
    the producer's completion is followed by stores alone instead of a read and a sum."""
    b = tl.program_id(0)
    epoch = tl.load(counter_ptr + b, volatile=True) + 1
    slot = (epoch & 1).to(tl.int64) * WORLD
    offs = b * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for r in tl.static_range(WORLD):
        bits = _arrived(here + (slot + r) * slot_elems + offs, mask)
        acc += bits.to(out_ptr.dtype.element_ty, bitcast=True).to(tl.float32)
    pdl_enter(USE_PDL)
    for r in tl.static_range(WORLD):
        tl.store(here + (slot + r) * slot_elems + offs, tl.full((BLOCK,), _EMPTY, tl.int16),
                 mask=mask)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(counter_ptr + b, epoch)


def sent_fits(numel: int, programs: int) -> bool:
    """Whether a ``SENT`` call of ``numel`` elements takes one block per program."""
    return numel <= programs * LAMPORT_MAX_BLOCK


#: ``push_all_reduce_kernel``'s lanes: (programs per call, the largest input in bytes).
#: A lane is one buffer and one set of counters, always launched with its own grid (the
#: kernel's slot reuse needs that); an input takes the first lane it fits. Few programs
#: win for one row, many for a batch of rows.
LAMPORT_LANES = ((16, 64 * 1024), (64, 512 * 1024))
#: The most elements a program handles per iteration of ``push_all_reduce_kernel``.
LAMPORT_MAX_BLOCK = 2048
#: The "not arrived" mark of ``push_all_reduce_kernel``: the bits of -0.0 in bf16/fp16.
LAMPORT_EMPTY = -32768
_EMPTY: tl.constexpr = tl.constexpr(LAMPORT_EMPTY)


@triton.jit
def push_send(values, offs, mask, bases_ptr, region, WORLD: tl.constexpr):
    """Store ``values`` (bf16/fp16) at element offsets ``offs`` of ``region`` in every
    rank's buffer (its own included), -0.0 sent as +0.0: -0.0 reads as "not arrived"."""
    bits = values.to(tl.int16, bitcast=True)
    bits = tl.where(bits == _EMPTY, 0, bits)
    for r in tl.static_range(WORLD):
        dst = tl.multiple_of(tl.load(bases_ptr + r).to(tl.pointer_type(tl.int16)), 16)
        tl.store(dst + region + offs, bits, mask=mask)


@triton.jit
def push_next_region(counter_ptr, rank, slot_elems, WORLD: tl.constexpr):
    """Where this rank's share of a lane's next call goes in every buffer (elements):
    region ``rank`` of the slot of the call's parity. ``counter_ptr``: the lane's program
    0 counter (a lane's programs all count every call)."""
    epoch = tl.load(counter_ptr) + 1
    return ((epoch & 1).to(tl.int64) * WORLD + rank) * slot_elems


def push_buffer_bytes(slot_bytes: int, world: int) -> int:
    """Bytes of one lane's buffer on each rank: two slots, each with room for every rank's
    share of up to ``slot_bytes``."""
    return 2 * world * slot_bytes


def push_block(numel: int, programs: int) -> int:
    """Elements per program and iteration for an all-reduce of ``numel`` elements."""
    per_program = triton.cdiv(numel, programs)
    return min(LAMPORT_MAX_BLOCK, max(128, triton.next_power_of_2(per_program)))


@triton.jit
def push_all_reduce_kernel(
    x_ptr,  # (numel,) this rank's input, bf16 or fp16
    out_ptr,  # (numel,) the sum, written; GATHER: (WORLD * numel,) every rank's input
    bases_ptr,  # (WORLD,) int64: every rank's buffer address
    counter_ptr,  # (programs,) int32: calls so far, per program
    numel,
    rank,
    slot_elems,  # elements per (slot, source rank) region
    WORLD: tl.constexpr,
    BLOCK: tl.constexpr,
    GATHER: tl.constexpr,  # an all-gather: rank r's input to out[r * numel:], no sum
    SENT: tl.constexpr,  # the shares were pushed by the producer's kernel: no push here
    USE_PDL: tl.constexpr,
):
    """A one-shot all-reduce without flags: the data is its own signal.

    Each rank's buffer holds two slots of ``WORLD`` regions, one per source rank, and
    every element that has not arrived holds -0.0 (``LAMPORT_EMPTY``). In call ``e``
    (``counter[b] + 1``, the same in every program: a lane's grid never changes) each
    program ``b`` pushes its share (-0.0 as +0.0) into region ``rank`` of slot ``e & 1`` of
    every rank's buffer; then, for each source rank in order, spins on its own buffer's
    region until no element is -0.0, adds it in float32 and writes -0.0 back; then stores
    the sum (the same bits on every rank), or with ``GATHER`` each rank's share in its
    place. A region is always cleared by the program that reads it, which makes reusing a
    slot two calls later safe (``docs/kernels.md``). ``SENT``: the producer's kernel
    already pushed the shares (``push_send``): this launch only sums and clears.
    """
    b = tl.program_id(0)
    elem = x_ptr.dtype.element_ty
    here = tl.multiple_of(tl.load(bases_ptr + rank).to(tl.pointer_type(tl.int16)), 16)
    if SENT:
        _sum_sent(out_ptr, here, counter_ptr, numel, slot_elems, WORLD, BLOCK, USE_PDL)
    else:
        pdl_enter(USE_PDL)  # the input comes from the previous kernel
        stride = tl.num_programs(0) * BLOCK
        epoch = tl.load(counter_ptr + b) + 1
        slot = (epoch & 1).to(tl.int64) * WORLD
        mine = (slot + rank) * slot_elems  # this rank's region of the slot, in every buffer
        for start in range(b * BLOCK, numel, stride):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < numel
            bits = tl.load(x_ptr + offs, mask=mask, other=0.0)
            push_send(bits, offs, mask, bases_ptr, mine, WORLD)
        for start in range(b * BLOCK, numel, stride):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < numel
            acc = tl.zeros((BLOCK,), dtype=tl.float32)
            for r in tl.static_range(WORLD):
                src = here + (slot + r) * slot_elems + offs
                bits = _arrived(src, mask)
                if GATHER:
                    tl.store(out_ptr + r * numel + offs, bits.to(elem, bitcast=True), mask=mask)
                else:
                    acc += bits.to(elem, bitcast=True).to(tl.float32)
                tl.store(src, tl.full((BLOCK,), _EMPTY, tl.int16), mask=mask)
            if not GATHER:
                tl.store(out_ptr + offs, acc.to(elem), mask=mask)
        tl.store(counter_ptr + b, epoch)
