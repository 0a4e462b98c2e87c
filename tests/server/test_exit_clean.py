"""A process that served and stopped exits without Triton's "nanobind: leaked ..." report: the server freezes
what start-up built out of the collector's reach (gc.freeze) and must unfreeze it on stop, or those objects are
never freed and nanobind lists every binding object still alive at exit."""
from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    if __name__ == "__main__":
        import triton  # noqa: F401  (the bindings whose leak check runs at exit)
        from sparrow import LLM
        from sparrow.server.launch import start_server
        llm = LLM(sys.argv[1], device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=16)
        srv = start_server(llm, port=int(sys.argv[2]))
        srv.stop()
        print("stopped")
""")


def test_no_nanobind_leak_report_at_exit(tiny_text_model_dir, tmp_path):
    from tests.server.conftest import _free_port

    script = tmp_path / "serve_and_stop.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(tiny_text_model_dir), str(_free_port())],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "stopped" in proc.stdout, proc.stderr[-2000:]
    assert "nanobind" not in proc.stderr, proc.stderr[-2000:]
