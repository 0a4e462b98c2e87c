"""Compute kernels. Each Triton kernel sits beside a torch twin with the same signature; the twin is
the CPU path and the test oracle (style.md 7-8)."""
