"""Programmatic dependent launch (PDL, CUDA compute capability >= 9.0; CUDA Programming Guide §4.5
"Programmatic Dependent Launch and Synchronization"): a kernel launched with ``launch_pdl=True`` may be
scheduled while the previous kernel of its stream still runs. ``pdl_enter`` is each such kernel's first
statement: ``griddepcontrol.wait`` holds the program until the previous kernel has completed and its memory
is visible (so no load or store of the kernel moves before it), then ``griddepcontrol.launch_dependents``
lets the next PDL kernel be scheduled in turn. What overlaps is a launch's latency and the grid's start, not
work. The launcher side is ``sparrow.kernels.use_pdl``."""
import triton
import triton.language as tl


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_rows_l2(base_ptr, rows, row_bytes, start_bytes, nbytes):
    """Hint the GPU to bring ``nbytes`` bytes of each row ``rows`` [B] of a row-major matrix at ``base_ptr``
    (row pitch ``row_bytes``), from byte ``start_bytes`` of the row, into L2: one ``cp.async.bulk.prefetch.L2``
    per row (PTX ISA 8.0, sm_90). Addresses and sizes must be multiples of 16 and inside the allocation; no
    data comes back and nothing waits for it. A PDL kernel calls it before ``pdl_enter`` for operands the
    previous kernel does not write (weights), so their first bytes travel while that kernel finishes."""
    addr = base_ptr.to(tl.int64, bitcast=True) + rows.to(tl.int64) * row_bytes + start_bytes
    size = tl.zeros_like(rows).to(tl.int32) + nbytes
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;", "=r,l,r",
                              [addr, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_tile_l2(w_ptr, row0, N, K, stride_wn, k_start, k_end, PREFETCH: tl.constexpr, BLOCK_N: tl.constexpr):
    """The program's weight tile toward L2 before its PDL wait: rows row0 .. row0 + BLOCK_N (clamped to N) of
    w [N, K] (unit stride on K), columns k_start .. k_end, at most PREFETCH bytes a row. The launcher checks
    that w, its row pitch and K * element size are multiples of 16 bytes."""
    ESZ: tl.constexpr = w_ptr.dtype.element_ty.primitive_bitwidth // 8
    rows = tl.minimum(row0 + tl.arange(0, BLOCK_N), N - 1)
    nb = tl.maximum(tl.minimum((k_end - k_start) * ESZ, PREFETCH) // 16 * 16, 16)
    start = tl.minimum(k_start * ESZ, K * ESZ - nb)  # an empty K split prefetches the row's last 16 bytes
    prefetch_rows_l2(w_ptr, rows, stride_wn * ESZ, start, nb)
