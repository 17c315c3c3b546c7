"""The repository's folders, for tests at any depth under tests/ (imported as a top-level
module: pytest puts tests/ on sys.path, pyproject.toml's pythonpath)."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def compile_flags() -> str:
    """The test session's XLA flags but for the CPU device count: what a script started from a
    test runs with (the session's compile settings, tests/conftest.py), the script setting up
    its own devices before JAX starts."""
    import os

    return " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                    if not f.startswith("--xla_force_host_platform_device_count"))
