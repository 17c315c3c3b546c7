"""The corpus (examples/lm_data.py): the by-file split under a byte cap."""

import pathlib
import sys

import numpy as np
import pytest
from _paths import ROOT

sys.path.insert(0, str(ROOT / "examples"))

import lm_data  # noqa: E402

_FRACTION = 0.5
_SIZE = 100  # bytes per file; each adds one separator to its stream


def _names(prefix: str, val: bool, count: int) -> list[str]:
    """The first ``count`` names ``{prefix}{i}.py`` that the path hash puts on ``val``'s side."""
    names = (f"{prefix}{i}.py" for i in range(1000))
    return [n for n in names if lm_data._is_val(n, _FRACTION) == val][:count]


def _write(root: pathlib.Path, names: list[str]) -> None:
    for k, name in enumerate(names):
        (root / name).write_bytes(bytes([ord("a") + k]) * _SIZE)


def _reads(monkeypatch) -> list[str]:
    read, original = [], pathlib.Path.read_bytes

    def read_bytes(self):
        read.append(self.name)
        return original(self)

    monkeypatch.setattr(pathlib.Path, "read_bytes", read_bytes)
    return read


def test_cap_reached_on_one_side_reads_the_first_file_of_the_other(tmp_path, monkeypatch):
    # In sorted order: three train files (the cap falls in the third), two validation files,
    # one more train file. Before the cap no file hashes to validation.
    a, b, c = _names("a", False, 3), _names("b", True, 2), _names("c", False, 1)
    _write(tmp_path, a + b + c)
    read = _reads(monkeypatch)
    cap = 2 * (_SIZE + 1) + 1
    corpus = lm_data.load_stdlib_corpus(_FRACTION, max_bytes=cap, root=str(tmp_path))
    assert (corpus.num_train_files, corpus.num_val_files) == (3, 1)
    assert read == a + b[:1]  # the train file past the cap and the second val file are not read
    assert corpus.train.size == 3 * (_SIZE + 1) and corpus.val.size == _SIZE + 1
    assert corpus.train.size + corpus.val.size <= cap + 2 * (_SIZE + 1)  # the cap, one file over
    assert np.all(corpus.val[:-1] == corpus.val[0]) and corpus.val[-1] == 0


def test_both_sides_before_the_cap_stop_at_the_cap(tmp_path, monkeypatch):
    a, b = _names("a", False, 1), _names("b", True, 3)
    _write(tmp_path, a + b)
    read = _reads(monkeypatch)
    corpus = lm_data.load_stdlib_corpus(_FRACTION, max_bytes=2 * (_SIZE + 1), root=str(tmp_path))
    assert (corpus.num_train_files, corpus.num_val_files) == (1, 1)
    assert read == a + b[:1]


def test_split_is_by_path_hash(tmp_path):
    names = [f"m{i}.py" for i in range(20)]
    _write(tmp_path, names)
    corpus = lm_data.load_stdlib_corpus(_FRACTION, max_bytes=None, root=str(tmp_path))
    num_val = sum(lm_data._is_val(n, _FRACTION) for n in names)
    assert (corpus.num_train_files, corpus.num_val_files) == (len(names) - num_val, num_val)


def test_one_side_empty_in_the_whole_corpus_is_an_error(tmp_path):
    _write(tmp_path, _names("a", False, 3))
    with pytest.raises(ValueError, match="too small to split"):
        lm_data.load_stdlib_corpus(_FRACTION, max_bytes=1, root=str(tmp_path))
