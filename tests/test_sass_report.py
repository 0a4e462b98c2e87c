"""benchmarks/sass_report.py compiles the 4-bit GEMV kernels for sm_90 on a machine without a GPU (Triton's own
ptxas and cuobjdump) and counts the SASS of their main loop: its smoke run must find, for an FMA tile and the
shipped dot tile, a register count, no spills and a main loop."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_sass_report_smoke():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sass_report.py"), "--smoke"], env=env,
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("dense int4")]
    assert len(lines) == 2 and "fma=True" in lines[0] and "swap_ab=True" in lines[1], out.stdout
    for line in lines:
        m = re.search(r"regs\s+(\d+)\s+stack\s+(\d+)\s+STL\s+(\d+)\s+loop\s+(\d+) ins", line)
        assert m, line
        regs, stack, stl, loop = map(int, m.groups())
        assert 0 < regs <= 255 and stl == 0 and loop > 0, line
