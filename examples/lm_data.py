"""Byte-level text that ships with every Python: the standard library's source files.

The corpus is split into train and validation *by file* (a file's bytes never appear in
both), so validation loss measures generalization to unseen modules rather than memorized
windows. Batches are a pure function of ``(seed, step)``: a restarted run draws exactly the
batches an uninterrupted run would have drawn, which is what makes ``--resume`` exact.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib
import sysconfig

import numpy as np

VOCAB_SIZE = 256  # bytes
_SEPARATOR = 0  # NUL never appears in source text; it marks file boundaries.


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Train and validation byte streams (uint8) with the files they came from."""

    train: np.ndarray
    val: np.ndarray
    num_train_files: int
    num_val_files: int
    root: str


def _is_val(relpath: str, val_fraction: float) -> bool:
    digest = hashlib.sha256(relpath.encode()).digest()
    return int.from_bytes(digest[:4], "little") / 2**32 < val_fraction


def load_stdlib_corpus(
    val_fraction: float = 0.05, *, max_bytes: int | None = 16 << 20, root: str | None = None
) -> Corpus:
    """Reads the standard library's ``*.py`` files into train/validation byte arrays.

    Args:
      val_fraction: fraction of *files* (chosen by a hash of their path, so the split is
        the same on every machine with the same Python) that go to validation.
      max_bytes: cap on the bytes read in total (files in sorted order), to bound memory and
        start-up time; ``None`` reads everything. Where the files before the cap all fall on
        one side of the split, the first file of the other side is read past it.
      root: directory to read; defaults to ``sysconfig.get_paths()['stdlib']``.

    Returns:
      A :class:`Corpus`.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}.")
    base = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    files = sorted(
        f for f in base.rglob("*.py") if "site-packages" not in f.parts and f.is_file()
    )
    if not files:
        raise ValueError(f"No *.py files under {base}; pass root= a directory with text files.")
    train_parts, val_parts, total = [], [], 0
    sep = bytes([_SEPARATOR])
    for f in files:
        rel = f.relative_to(base).as_posix()
        side = val_parts if _is_val(rel, val_fraction) else train_parts
        if max_bytes is not None and total >= max_bytes:
            if train_parts and val_parts:
                break
            # Past the cap, only the first file of the side still empty: which files hash to
            # validation depends on the Python version's stdlib (3.13's first 0.5 MB has none),
            # and a split needs a file on each side.
            if side:
                continue
        data = f.read_bytes().replace(sep, b"")
        side.append(data + sep)
        total += len(data) + 1
    if not train_parts or not val_parts:
        raise ValueError("The corpus is too small to split; raise max_bytes or val_fraction.")
    as_array = lambda parts: np.frombuffer(b"".join(parts), dtype=np.uint8)
    return Corpus(
        train=as_array(train_parts),
        val=as_array(val_parts),
        num_train_files=len(train_parts),
        num_val_files=len(val_parts),
        root=str(base),
    )


def sample_batch(
    stream: np.ndarray, batch_size: int, seq_len: int, *, seed: int, step: int
) -> np.ndarray:
    """Random windows of ``seq_len + 1`` bytes, a pure function of ``(seed, step)``.

    Returns:
      int32 array [batch_size, seq_len + 1]: inputs are ``[:, :-1]``, targets ``[:, 1:]``.
    """
    return batch_rows(stream, batch_size, seq_len, seed=seed, step=step)


def batch_rows(stream: np.ndarray, batch_size: int, seq_len: int, *, seed: int, step: int,
               rows: slice = slice(None)) -> np.ndarray:
    """Rows ``rows`` of :func:`sample_batch`'s batch, reading only their bytes (the window
    starts of the whole batch are drawn, a few integers): a process of a multi-process run
    builds just the rows its devices hold, the same rows any process count would draw."""
    if stream.size <= seq_len + 1:
        raise ValueError(f"seq_len={seq_len} is longer than the stream ({stream.size} bytes).")
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, stream.size - seq_len - 1, size=batch_size)[rows]
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    return stream[idx].astype(np.int32)


def eval_batches(
    stream: np.ndarray, batch_size: int, seq_len: int, num_batches: int
) -> list[np.ndarray]:
    """A fixed set of evenly spaced validation windows (the same at every evaluation)."""
    n = batch_size * num_batches
    span = stream.size - seq_len - 1
    if span <= 0:
        raise ValueError(f"seq_len={seq_len} is longer than the validation stream.")
    starts = np.linspace(0, span - 1, n).astype(np.int64)
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    windows = stream[idx].astype(np.int32)
    return [windows[i * batch_size : (i + 1) * batch_size] for i in range(num_batches)]
