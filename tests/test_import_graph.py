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
_PACKAGES = ("accel_kernels", "moe", "muon_jax", "xla_comm")


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


# The layers: each package may stand on the kernel layer, none on another package.
_LIBRARY = ("accel_kernels", "moe", "muon_jax", "xla_comm")
_MAY_IMPORT = {"accel_kernels": set(), "moe": {"accel_kernels"}, "muon_jax": {"accel_kernels"},
               "xla_comm": {"accel_kernels"}}


def _top_level_imports(path: Path) -> list[tuple[str, str | None, int]]:
    """``(module, name or None, line)`` of every absolute import in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out += [(node.module, a.name, node.lineno) for a in node.names]
    return out


def _cross_imports(package: str) -> list[str]:
    found = []
    for path in sorted((_ROOT / package).rglob("*.py")):
        for module, _, line in _top_level_imports(path):
            top = module.split(".")[0]
            if top in _LIBRARY and top != package and top not in _MAY_IMPORT[package]:
                found.append(f"{path.relative_to(_ROOT).as_posix()}:{line}: {module}")
    return found


@pytest.mark.parametrize("package", _LIBRARY)
def test_packages_stand_only_on_the_kernel_layer(package):
    assert _cross_imports(package) == []


def test_layer_finder_sees_a_cross_import(tmp_path, monkeypatch):
    (tmp_path / "moe").mkdir()
    (tmp_path / "moe" / "a.py").write_text("import accel_kernels\nfrom muon_jax import muon\n")
    monkeypatch.setitem(globals(), "_ROOT", tmp_path)
    assert _cross_imports("moe") == ["moe/a.py:2: muon_jax"]


def _public(package: str) -> set[str]:
    """The names of ``package/__init__.py``'s ``__all__``."""
    tree = ast.parse((_ROOT / package / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__"
                                                for t in node.targets):
            return {ast.literal_eval(e) for e in node.value.elts}
    return set()


def _internal_uses(paths) -> list[str]:
    """Imports of the library reaching past a package's ``__all__``: ``import pkg.sub`` or
    ``from pkg.sub import x`` for a ``sub`` not in it, or ``from pkg import x`` likewise."""
    public = {p: _public(p) for p in _LIBRARY}
    found = []
    for path in paths:
        for module, name, line in _top_level_imports(path):
            parts = module.split(".")
            if parts[0] not in _LIBRARY:
                continue
            first = parts[1] if len(parts) > 1 else name
            if first is not None and first not in public[parts[0]]:
                found.append(f"{path.name}:{line}: {module}"
                             + (f".{name}" if name and len(parts) == 1 else ""))
    return found


def test_examples_and_notebooks_use_public_apis_only():
    paths = sorted([*(_ROOT / "examples").glob("*.py"), *(_ROOT / "notebooks").glob("*.py")])
    assert _internal_uses(paths) == []


def test_internal_use_finder_sees_an_internal_import(tmp_path):
    bad = tmp_path / "ex.py"
    bad.write_text("import moe\nfrom moe import MoE\nfrom accel_kernels.gmm.mosaic_kernel "
                   "import gmm\nfrom muon_jax import owners\n")
    assert _internal_uses([bad]) == ["ex.py:3: accel_kernels.gmm.mosaic_kernel",
                                     "ex.py:4: muon_jax.owners"]


def test_importing_the_packages_loads_no_pallas_backend():
    """``import moe, muon_jax`` on a CPU adds no Pallas, Mosaic GPU or Triton module to what
    jax, flax and optax import: the kernel registries import their implementations on first
    use (``accel_kernels.registry``)."""
    import subprocess
    import sys

    code = ("import sys; import jax, flax.nnx, optax; before = set(sys.modules); "
            "import moe, muon_jax, xla_comm; print(sorted(m for m in set(sys.modules) - before "
            "if any(k in m for k in ('pallas', 'mosaic', 'triton'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=_ROOT, check=True).stdout.strip()
    assert out == "[]"


@pytest.mark.parametrize("package", _LIBRARY)
def test_packages_are_marked_typed(package):
    """PEP 561: each package ships a py.typed marker (pyproject's package-data installs it)."""
    assert (_ROOT / package / "py.typed").is_file()
