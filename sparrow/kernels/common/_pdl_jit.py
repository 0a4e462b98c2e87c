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

