"""The repository's folders, for tests at any depth under tests/ (imported as a top-level
module: pytest puts tests/ on sys.path, pyproject.toml's pythonpath)."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
