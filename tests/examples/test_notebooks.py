"""Each notebooks/<name>.ipynb holds exactly the cells of its jupytext source <name>.py."""

import pytest
from _paths import ROOT

jupytext = pytest.importorskip(
    "jupytext", reason="jupytext (in the 'test' extra) reads the notebooks' .py sources"
)

NOTEBOOKS = ROOT / "notebooks"
IPYNBS = sorted(NOTEBOOKS.glob("*.ipynb"))


def _cells(nb):
    return [(c.cell_type, c.source) for c in nb.cells]


def test_each_notebook_has_a_py_source_and_back():
    sources = {p.stem for p in NOTEBOOKS.glob("*.py")} - {"conftest"}
    assert IPYNBS and {p.stem for p in IPYNBS} == sources


@pytest.mark.parametrize("ipynb", IPYNBS, ids=lambda p: p.name)
def test_ipynb_is_in_sync_with_its_py(ipynb):
    nb, src = jupytext.read(ipynb), jupytext.read(ipynb.with_suffix(".py"))
    fix = f"edit notebooks/{ipynb.stem}.py, then run `jupytext --sync notebooks/{ipynb.stem}.py`"
    assert _cells(nb) == _cells(src), f"{ipynb.name} differs from its .py: {fix}"
    assert nb.metadata["jupytext"]["formats"] == "ipynb,py:percent", fix
    assert not any(c.get("outputs") for c in nb.cells), f"commit {ipynb.name} without outputs"
