"""No block of six or more lines stands twice in sparrow/kernels/ (issue 42: a helper two kernels need lives in one
place, ``kernels/common`` or the family's own ``_*_jit`` module, and a launcher states its twin's parameter types by
reference instead of copying them).

Read as text, not imported: each line is stripped and its white space folded; blank lines, comments, import lines
and lines of punctuation alone (``)``, ``):``, ``]``) are passed over. Two runs of MIN_LINES such lines that are
equal, in two files or at two non-overlapping places of one file, fail the test with both places named.
Runnable as a script: prints every repeated run.
"""
from __future__ import annotations

import re
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "sparrow" / "kernels"
MIN_LINES = 6

_PUNCTUATION = re.compile(r"^[\s()\[\]{}:,.'\"\\]*$")
_IMPORT = re.compile(r"^(import\s|from\s+\S+\s+import\s)")


def significant_lines(text: str) -> list[tuple[int, str]]:
    """(line number, normalized text) of the lines that count."""
    out = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = " ".join(raw.split())
        if not line or line.startswith("#") or _IMPORT.match(line) or _PUNCTUATION.match(line):
            continue
        out.append((number, line))
    return out


def repeated_runs(root: Path = KERNELS, min_lines: int = MIN_LINES) -> list[str]:
    """One line per repeated run of ``min_lines`` significant lines: ``a.py:L1 ~ b.py:L2``, the runs' first lines."""
    seen: dict[tuple[str, ...], tuple[str, int, int]] = {}
    found = []
    for path in sorted(root.rglob("*.py")):
        name = str(path.relative_to(root))
        lines = significant_lines(path.read_text())
        texts = [t for _, t in lines]
        last_reported = -min_lines
        for i in range(len(lines) - min_lines + 1):
            key = tuple(texts[i:i + min_lines])
            first = seen.get(key)
            if first is None:
                seen[key] = (name, i, lines[i][0])
            elif (first[0] != name or i - first[1] >= min_lines) and i - last_reported >= min_lines:
                found.append(f"{first[0]}:{first[2]} ~ {name}:{lines[i][0]}")
                last_reported = i
    return found


def test_reader_finds_a_copied_block(tmp_path):
    """The reader itself: a six-line block copied into a second file (other indentation, other comments and
    blank lines between) is found; five lines are not."""
    block = "".join(f"x{i} = f(y, {i})\n" for i in range(6))
    (tmp_path / "a.py").write_text("import os\n" + block)
    (tmp_path / "b.py").write_text("def g():\n" + "".join(f"    {line}\n\n    # note\n" for line in block.splitlines()))
    assert repeated_runs(tmp_path) == ["a.py:2 ~ b.py:2"]
    (tmp_path / "b.py").write_text("".join(block.splitlines(True)[:5]))
    assert repeated_runs(tmp_path) == []


def test_no_repeated_block_in_kernels():
    assert KERNELS.is_dir()
    assert repeated_runs() == []


if __name__ == "__main__":
    for row in repeated_runs():
        print(row)
