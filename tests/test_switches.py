"""sparrow.switches: every environment switch in one typed table, read once; no other module of sparrow/ reads
the environment (the cache folder in sparrow/cache.py aside). Oracle: the stated contract of the module doc."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from sparrow import switches

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {"sparrow/switches.py", "sparrow/cache.py"}


def test_table_lists_each_switch_with_type_default_and_doc():
    assert set(switches.SWITCHES) == {"SPARROW_OVERLAP", "SPARROW_PDL", "SPARROW_DUAL_STREAM", "SPARROW_SPEC_CLOSED_BATCH",
                                      "SPARROW_LORA_UNLOAD_TIMEOUT_S", "TRITON_INTERPRET"}
    for s in switches.SWITCHES.values():
        assert s.type in (bool, float) and isinstance(s.default, s.type) and s.doc
    assert switches.SWITCHES["SPARROW_PDL"].default is True and switches.SWITCHES["SPARROW_OVERLAP"].default is True


def _read(env: dict[str, str]) -> subprocess.CompletedProcess:
    code = "from sparrow import switches as s; print(s.OVERLAP, s.PDL, s.TRITON_INTERPRET)"
    base = {k: v for k, v in __import__("os").environ.items()
            if k not in ("SPARROW_OVERLAP", "SPARROW_PDL", "TRITON_INTERPRET")}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**base, **env}, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("env,want", [({}, "True True False"),
                                      ({"SPARROW_PDL": "0", "SPARROW_OVERLAP": "off"}, "False False False"),
                                      ({"SPARROW_PDL": "", "TRITON_INTERPRET": "1"}, "True True True"),
                                      ({"SPARROW_OVERLAP": "TRUE", "TRITON_INTERPRET": "0"}, "True True False")])
def test_values_are_read_from_the_environment(env, want):
    out = _read(env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[-2] == want


def test_unreadable_value_names_the_variable():
    out = _read({"SPARROW_PDL": "maybe"})
    assert out.returncode != 0 and "SwitchError" in out.stderr and "SPARROW_PDL='maybe'" in out.stderr


@pytest.mark.parametrize("raw,ok", [("2.5", True), ("0", True), ("-1", False), ("soon", False), ("nan", False),
                                    ("inf", False)])
def test_number_switch(raw, ok):
    code = "from sparrow import switches as s; print(s.LORA_UNLOAD_TIMEOUT_S)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "SPARROW_LORA_UNLOAD_TIMEOUT_S": raw})
    if ok:
        assert out.returncode == 0 and float(out.stdout.split("\n")[-2]) == float(raw), out.stderr
    else:
        assert out.returncode != 0 and f"SPARROW_LORA_UNLOAD_TIMEOUT_S={raw!r}: expected a number >= 0" in out.stderr


def _environment_reads(path: Path) -> list[int]:
    """Lines of ``os.environ`` / ``os.getenv`` / ``environ`` / ``getenv`` uses in a module."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb"):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" \
                and any(a.name in ("environ", "getenv", "environb") for a in node.names):
            lines.append(node.lineno)
    return lines


def test_no_environment_read_outside_switches():
    found = {}
    for path in sorted((ROOT / "sparrow").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel not in ALLOWED and (lines := _environment_reads(path)):
            found[rel] = lines
    assert found == {}
