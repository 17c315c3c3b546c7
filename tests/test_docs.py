"""Every Python block of the README and docs/ runs as written (so they cannot rot): each in a
fresh namespace, on the test session's 8 CPU devices."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^( *)```python\n(.*?)^\1```", re.S | re.M)


def _blocks():
    for path in FILES:
        text = path.read_text()
        for m in _BLOCK.finditer(text):
            indent = len(m.group(1))
            code = "\n".join(line[indent:] for line in m.group(2).splitlines())
            line = text[:m.start()].count("\n") + 1
            yield pytest.param(code, id=f"{path.name}:{line}")


BLOCKS = list(_blocks())


def test_the_docs_have_python_blocks():
    assert len(BLOCKS) >= 4


@pytest.mark.parametrize("code", BLOCKS)
def test_block_runs_as_written(code, capsys):
    exec(compile(code, "<doc block>", "exec"), {"__name__": "__doc_block__"})
