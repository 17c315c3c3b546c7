"""optax's own Muon test file, run against muon_jax (`muon_jax.optax_compat`).

The file ships with optax (``optax/contrib/_muon_test.py``); it is read from the installed
optax and adapted only by the renames its API needs here: the module under test is
``muon_jax.optax_compat`` instead of ``optax.contrib._muon``, and its private
``_compute_muon_reshape`` is the public ``compute_muon_reshape``. Nothing of it is copied into
this repository. A different optax without that file skips these tests, saying so.
"""

import pathlib
import types
import unittest

import optax
import pytest

SOURCE = pathlib.Path(optax.__file__).parent / "contrib" / "_muon_test.py"
RENAMES = (
    ("from optax.contrib import _muon\n", "from muon_jax import optax_compat as _muon\n"),
    ("_muon._compute_muon_reshape(", "_muon.compute_muon_reshape("),
)


def _adapted_cases() -> list[unittest.TestCase]:
    if not SOURCE.exists():
        return []
    src = SOURCE.read_text()
    for old, new in RENAMES:
        assert old in src, f"optax's test file changed: {old!r} not found"
        src = src.replace(old, new)
    module = types.ModuleType("optax_muon_test_on_muon_jax")
    exec(compile(src, str(SOURCE), "exec"), module.__dict__)  # noqa: S102 - optax's own test
    loader = unittest.TestLoader()
    return [case for name, obj in vars(module).items() if isinstance(obj, type)
            and issubclass(obj, unittest.TestCase) for case in loader.loadTestsFromTestCase(obj)]


CASES = _adapted_cases()


@pytest.mark.skipif(not CASES, reason=f"this optax ({optax.__version__}) has no {SOURCE.name}")
def _name(case: unittest.TestCase) -> str:
    """The test method's name (absl's description, which holds a memory address, dropped)."""
    return case._testMethodName  # noqa: SLF001 - unittest's own record of it


@pytest.mark.parametrize("case", CASES, ids=_name)
def test_optax_muon_test_passes_against_muon_jax(case):
    result = unittest.TestResult()
    case.run(result)
    problems = result.errors + result.failures
    assert not problems, problems[0][1]
    assert result.testsRun == 1
