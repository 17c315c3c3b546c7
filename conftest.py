"""Test-session setup for the whole repository: 8 simulated CPU devices, doctests from the packages.

The device count is set here, before JAX initializes, for everything the test command runs:
the tests, the packages' doctests and the notebooks (their kernels inherit the environment).
"""

import os
from importlib import metadata

# The tests' programs are tiny and compile time dominates: XLA:CPU's backend optimization
# level 0 compiles about 40% faster (the suite: 15.5 -> 11.3 minutes on 2 cores). Before jax
# 0.12 the suite passes either way; jax 0.12's XLA:CPU at level 0 computes the trainer's
# micro-batched forward wrongly (the same program at the default level matches the one-stream
# one to 1e-6, at level 0 it is 3e-3 off: tests/examples/test_lm_micro_batches.py), so there
# the default level stays.
_JAX_MAJOR_MINOR = tuple(int(v) for v in metadata.version("jax").split(".")[:2])
_FAST_COMPILE = " --xla_backend_optimization_level=0" if _JAX_MAJOR_MINOR < (0, 12) else ""
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8" + _FAST_COMPILE
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One on-disk compilation cache per checkout, shared by the xdist workers and every process
# they start (notebook kernels, the trainer's subprocesses), which compile many of the same
# programs.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(os.path.dirname(os.path.abspath(__file__)), ".jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

_DOCTESTED = ("muon_jax", "moe", "xla_comm")
# The tests that lean most on jax internals (CUDA and TPU cross-lowerings, Pallas kernels in
# interpret mode) and, with the doctests, carry the marker `jax_internals`: .ci/run runs them
# once more on the newest Python with the newest jax (`pytest -m jax_internals`). The layer
# variants are among them: autodiff inside shard_map is where a new jax's type checks bite.
_JAX_INTERNALS = frozenset({
    "test_cuda_export.py", "test_fp8_dense.py", "test_fp8_lowering.py", "test_fp8_widths.py",
    "test_fp8_wire_gemm.py", "test_no_triton_on_hopper.py", "test_tpu_export.py",
    "test_variants.py",
})
_KERNEL_TESTS = os.path.join("tests", "accel_kernels")  # every kernel test file
# The tests of the example trainer and the benchmark scripts check those scripts; the
# packages' coverage (the full run's --cov-fail-under) is the packages' own tests'. Coverage's
# tracer (sys.settrace on Python 3.11) slows jax's Python-heavy tracing by about half, and
# these tests trace whole trainers and benchmark steps, so they run untraced (pytest-cov's
# no_cover marker): it keeps the suite within its time budget.
_SCRIPT_TESTS = (os.path.join("tests", "examples"), os.path.join("tests", "benchmarks"))


def _measuring_coverage(config) -> bool:
    # pytest-cov's no_cover marker fails the test under --no-cov (it pauses a controller
    # that does not exist), so it is only added while coverage runs.
    return bool(config.pluginmanager.has_plugin("_cov") and config.getoption("cov_source", None)
                and not config.getoption("no_cov", False))


def pytest_collection_modifyitems(config, items):
    untraced = _measuring_coverage(config)
    for item in items:
        if untraced and any(item.path.is_relative_to(config.rootpath / d) for d in _SCRIPT_TESTS):
            item.add_marker(pytest.mark.no_cover)
        in_kernels = item.path.is_relative_to(config.rootpath / _KERNEL_TESTS)
        if (item.path.name in _JAX_INTERNALS or in_kernels
                or type(item).__name__ == "DoctestItem"):
            item.add_marker(pytest.mark.jax_internals)


@pytest.hookimpl(wrapper=True)
def pytest_collect_file(file_path, parent):
    """``--doctest-modules`` reads the packages only: test files and scripts are not imported."""
    collectors = yield
    root = parent.config.rootpath
    if file_path.is_relative_to(root) and file_path.relative_to(root).parts[0] in _DOCTESTED:
        return collectors
    doctest_module = parent.config.pluginmanager.get_plugin("doctest").DoctestModule
    return [c for c in collectors if not isinstance(c, doctest_module)]
