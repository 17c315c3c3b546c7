"""The packages' import graph: no cycles, and no private name taken from another module.

Read from the source (``ast``), so it sees every import, those inside functions included (a lazy
import hides a cycle from the interpreter, not from a reader). A module's *private* names start
with ``_``; a module may import its package's public modules and their public names only.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

import pytest

_ROOT = Path(__file__).resolve().parents[1]
_PACKAGES = ("moe", "muon_jax", "xla_comm")


def _module_name(path: Path) -> str:
    parts = path.relative_to(_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(package: str) -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((_ROOT / package).rglob("*.py"))}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module of ``modules`` that ``name`` (a module or ``module.attribute``) lives in."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


class _Import(NamedTuple):
    target: str  # the module imported, or the module a name is taken from
    attr: str | None  # the name taken from ``target`` (None: the module itself)
    bound: str  # the name it is bound to here
    line: int


def _imports(module: str, path: Path, modules: dict[str, Path]):
    """Every import in ``path`` of a module of ``modules`` (or of a name from one)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _resolve(alias.name, modules)
                if target:
                    bound = alias.asname or alias.name.split(".")[0]
                    yield _Import(target, None, bound, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = module if is_pkg else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    here = here.rpartition(".")[0]
                base = f"{here}.{base}" if base else here
            for alias in node.names:
                full, bound = f"{base}.{alias.name}", alias.asname or alias.name
                if full in modules:  # a submodule
                    yield _Import(full, None, bound, node.lineno)
                elif (target := _resolve(base, modules)):
                    yield _Import(target, alias.name, bound, node.lineno)


def _graph(package: str) -> dict[str, set[str]]:
    modules = _modules(package)
    return {m: {i.target for i in _imports(m, p, modules) if i.target != m}
            for m, p in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_sees_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("package", _PACKAGES)
def test_no_import_cycles(package):
    assert _cycles(_graph(package)) == []


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_uses(package: str) -> list[str]:
    """``file:line: name`` of each private name one module takes from another: an import of
    a private module or name, or an attribute ``mod._name`` of a module imported here."""
    modules = _modules(package)
    found = []
    for module, path in modules.items():
        rel = path.relative_to(_ROOT).as_posix()
        bound_modules = set()
        for imp in _imports(module, path, modules):
            taken = imp.target if imp.attr is None else f"{imp.target}.{imp.attr}"
            if any(_private(part) for part in taken.split(".")):
                found.append(f"{rel}:{imp.line}: {taken}")
            if imp.attr is None:
                bound_modules.add(imp.bound)
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and _private(node.attr)
                    and isinstance(node.value, ast.Name) and node.value.id in bound_modules):
                found.append(f"{rel}:{node.lineno}: {node.value.id}.{node.attr}")
    return sorted(set(found))


def test_private_finder_sees_private_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def _hidden():\n    pass\n\n\ndef shown():\n    pass\n")
    (pkg / "b.py").write_text("from pkg.a import _hidden\nfrom pkg import a\na._hidden()\n"
                              "a.shown()\n")
    monkeypatch.setitem(globals(), "_ROOT", tmp_path)
    assert _private_uses("pkg") == ["pkg/b.py:1: pkg.a._hidden", "pkg/b.py:3: a._hidden"]


@pytest.mark.parametrize("package", _PACKAGES)
def test_no_private_names_across_modules(package):
    assert _private_uses(package) == []
