"""Leaves as batches of matrices: dimension numbers, the ``[B, m, n]`` view and shape scaling.

A leaf of any rank becomes a batch of independent matrices once its axes are split into
reduction (fan-in, ``m``), output (fan-out, ``n``) and batch axes (everything else), as in
:class:`optax.contrib.MuonDimensionNumbers`; :class:`SplitDimensionNumbers` also cuts one axis
of a fused leaf (gate and up projections side by side, fused QKV) into its separate matrices.
These pure functions do that split and its inverse, so the unsharded transform and the sharded
(stacked) path share one definition.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple, TypeAlias

import jax
import jax.numpy as jnp
import optax

MuonDimensionNumbers = optax.contrib.MuonDimensionNumbers

ShapeScaling: TypeAlias = Literal["spectral", "spectral_unclamped", "rms_match"] | float | None
SHAPE_SCALINGS: tuple[str, ...] = ("spectral", "spectral_unclamped", "rms_match")
DimNumsLike: TypeAlias = Any  # MuonDimensionNumbers | tree (prefix) of them | callable on params

RMS_MATCH_FACTOR = 0.2
"""Moonlight's factor: ``0.2 * sqrt(max(m, n))`` gives updates the RMS of AdamW's."""


@dataclasses.dataclass(frozen=True)
class SplitDimensionNumbers:
    """Dimension numbers of a fused leaf: ``parts`` separate maps side by side along
    ``split_axis``, each orthogonalized on its own.

    The axes are the leaf's own, as in :class:`optax.contrib.MuonDimensionNumbers`;
    ``split_axis`` (one of the reduction or output axes) holds ``parts`` equal consecutive
    blocks, and each block is a matrix of its own (the blocks count as a batch). A fused
    gate/up bank ``[E, d, 2 f]`` (gate columns first) is ``SplitDimensionNumbers(1, 2,
    split_axis=2)``: ``2 E`` matrices ``[d, f]``; a fused QKV kernel ``[d, 3 d]`` is
    ``SplitDimensionNumbers(0, 1, split_axis=1, parts=3)``.

    Attributes:
      reduction_axis: the fan-in axis or axes.
      output_axis: the fan-out axis or axes.
      split_axis: the fused axis.
      parts: how many matrices lie side by side along it, ``>= 2``.

    Example:
      >>> view = matrix_view((4, 8, 6), SplitDimensionNumbers(1, 2, split_axis=2))
      >>> view.batch, view.m, view.n, view.leaf_shape
      (8, 8, 3, (4, 8, 6))
    """

    reduction_axis: int | tuple[int, ...] = 0
    output_axis: int | tuple[int, ...] = 1
    split_axis: int = 1
    parts: int = 2

    def __post_init__(self):
        for name in ("split_axis", "parts"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"SplitDimensionNumbers: {name}={v!r} is not an int; pass e.g. "
                                "SplitDimensionNumbers(1, 2, split_axis=2, parts=2).")
        if self.parts < 2:
            raise ValueError(f"SplitDimensionNumbers: parts={self.parts} must be >= 2 (the "
                             "matrices side by side); use MuonDimensionNumbers for one matrix.")
        for name in ("reduction_axis", "output_axis"):
            v = getattr(self, name)
            if not isinstance(v, int):
                object.__setattr__(self, name, tuple(v))


DIM_NUMS_TYPES = (MuonDimensionNumbers, SplitDimensionNumbers)
"""The types of one leaf's dimension numbers."""


class MatrixView(NamedTuple):
    """How one leaf is viewed as a ``[B, m, n]`` batch of matrices (axes non-negative, static).

    The axes index ``shape``; with ``split = (axis, parts)`` that is the leaf's shape with its
    ``axis`` cut into ``(parts, size // parts)`` (:class:`SplitDimensionNumbers`), and
    :attr:`leaf_shape` is the leaf's own.

    Example:
      >>> from muon_jax.matrices import MatrixView
      >>> view = MatrixView(batch_axes=(0,), reduction_axes=(1, 2), output_axes=(3,),
      ...                   shape=(2, 3, 4, 5))
      >>> view.batch, view.m, view.n
      (2, 12, 5)
    """

    batch_axes: tuple[int, ...]
    reduction_axes: tuple[int, ...]
    output_axes: tuple[int, ...]
    shape: tuple[int, ...]
    split: tuple[int, int] | None = None

    @property
    def leaf_shape(self) -> tuple[int, ...]:
        """The leaf's shape (``shape`` with the split axis merged back)."""
        if self.split is None:
            return self.shape
        s = self.split[0]
        return self.shape[:s] + (self.shape[s] * self.shape[s + 1],) + self.shape[s + 2:]

    def leaf_axis(self, axis: int) -> int:
        """The leaf axis that axis ``axis`` of ``shape`` is (a part of)."""
        return axis if self.split is None or axis <= self.split[0] else axis - 1

    def with_leaf_shape(self, leaf_shape: Sequence[int]) -> MatrixView:
        """The same view of a leaf of shape ``leaf_shape`` (e.g. one device's block)."""
        leaf_shape = tuple(leaf_shape)
        if self.split is None:
            return self._replace(shape=leaf_shape)
        s, parts = self.split
        return self._replace(
            shape=leaf_shape[:s] + (parts, leaf_shape[s] // parts) + leaf_shape[s + 1:])

    @property
    def batch(self) -> int:
        """Number of matrices ``B`` (1 for a 2-D leaf)."""
        return math.prod(self.shape[a] for a in self.batch_axes)

    @property
    def m(self) -> int:
        """Fan-in: product of the reduction axes."""
        return math.prod(self.shape[a] for a in self.reduction_axes)

    @property
    def n(self) -> int:
        """Fan-out: product of the output axes."""
        return math.prod(self.shape[a] for a in self.output_axes)


def path_str(path: Sequence[Any]) -> str:
    """Human-readable leaf path such as ``'layers/0/kernel'`` from a JAX key path.

    Args:
      path: a key path from :func:`jax.tree_util.tree_flatten_with_path`.

    Returns:
      The key names joined by ``'/'`` (``'<root>'`` for the empty path).

    >>> import jax
    >>> path_str(jax.tree_util.tree_flatten_with_path({'a': [1, 2]})[0][1][0])
    'a/1'
    """
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(k.name)
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            parts.append(str(k.key))
        else:
            parts.append(str(k))
    return "/".join(parts) or "<root>"


def _axes(value: Any, ndim: int, what: str, where: str) -> tuple[int, ...]:
    """Normalized non-negative axes of one dimension-numbers entry; errors name the leaf."""
    axes = (value,) if isinstance(value, int) else tuple(value)
    out = []
    for ax in axes:
        if not isinstance(ax, int) or not -ndim <= ax < ndim:
            raise ValueError(
                f"{where}: {what} {value!r} does not fit a leaf of rank {ndim}; give axes in "
                f"[-{ndim}, {ndim}) or route this leaf to AdamW (muon_mask)."
            )
        out.append(ax % ndim)
    if not out:
        raise ValueError(f"{where}: {what} is empty; give at least one axis.")
    return tuple(out)


def matrix_view(
    shape: Sequence[int], dim_nums: MuonDimensionNumbers | SplitDimensionNumbers | None = None,
    *, path: str = "leaf",
) -> MatrixView:
    """Split a leaf's axes into batch, reduction and output axes.

    Without dimension numbers, the last two axes are the matrix (reduction ``-2``, output
    ``-1``) and leading axes are batch: ``[m, n]`` is one matrix (optax's default), ``[L, m, n]``
    a stack. Kernels whose fan-in spans several axes (convolutions ``[kh, kw, c_in, c_out]``)
    need explicit ``MuonDimensionNumbers(reduction_axis=(0, 1, 2), output_axis=3)``.

    Args:
      shape: the leaf's shape, rank ``>= 2``.
      dim_nums: optional :class:`optax.contrib.MuonDimensionNumbers` or
        :class:`SplitDimensionNumbers`.
      path: the leaf's path, used in error messages.

    Returns:
      A :class:`MatrixView`.

    >>> view = matrix_view((3, 4, 5))
    >>> view.batch, view.m, view.n
    (3, 4, 5)
    """
    shape = tuple(int(d) for d in shape)
    ndim = len(shape)
    if dim_nums is None:
        if ndim < 2:
            raise ValueError(
                f"{path}: Muon needs a matrix (rank >= 2), got shape {shape}; route it to AdamW "
                "(muon_mask) or give MuonDimensionNumbers."
            )
        return MatrixView(tuple(range(ndim - 2)), (ndim - 2,), (ndim - 1,), shape)
    if not isinstance(dim_nums, DIM_NUMS_TYPES):
        raise TypeError(
            f"{path}: dimension numbers must be optax.contrib.MuonDimensionNumbers or "
            f"muon_jax.SplitDimensionNumbers, got {type(dim_nums).__name__}."
        )
    red = _axes(dim_nums.reduction_axis, ndim, "reduction_axis", path)
    out = _axes(dim_nums.output_axis, ndim, "output_axis", path)
    if len(set(red)) != len(red) or len(set(out)) != len(out) or set(red) & set(out):
        raise ValueError(
            f"{path}: reduction axes {red} and output axes {out} of {dim_nums} must be distinct "
            f"and disjoint for shape {shape}; every axis is reduction, output or batch."
        )
    if isinstance(dim_nums, SplitDimensionNumbers):
        return _split_view(shape, red, out, dim_nums, path)
    batch = tuple(a for a in range(ndim) if a not in red and a not in out)
    return MatrixView(batch, red, out, shape)


def _split_view(shape: tuple[int, ...], red: tuple[int, ...], out: tuple[int, ...],
                dim_nums: SplitDimensionNumbers, path: str) -> MatrixView:
    """The view of a fused leaf: its split axis cut into ``(parts, size // parts)``, the
    ``parts`` axis a batch axis and the other part keeping the split axis's role."""
    s = _axes(dim_nums.split_axis, len(shape), "split_axis", path)[0]
    parts = dim_nums.parts
    if s not in red + out:
        raise ValueError(f"{path}: split_axis {s} of {dim_nums} is neither a reduction nor an "
                         "output axis; split one of them (a batch axis is already a batch).")
    if shape[s] % parts:
        raise ValueError(f"{path}: split_axis {s} of size {shape[s]} (shape {shape}) does not "
                         f"split into {parts} equal parts; check parts= or the leaf.")

    def lift(axes):  # leaf axes -> axes of the split shape (the split axis: its minor part)
        return tuple(a if a < s else a + 1 for a in axes)

    split_shape = shape[:s] + (parts, shape[s] // parts) + shape[s + 1:]
    red, out = lift(red), lift(out)
    batch = tuple(a for a in range(len(split_shape)) if a not in red and a not in out)
    return MatrixView(batch, red, out, split_shape, (s, parts))


def to_matrices(x: jax.Array, view: MatrixView) -> jax.Array:
    """Transpose and reshape a leaf to its ``[B, m, n]`` batch of matrices.

    ``x.transpose(batch + reduction + output).reshape(B, m, n)``, the same order as optax.

    Args:
      x: the leaf, of shape ``view.shape``.
      view: from :func:`matrix_view`.

    Returns:
      Array of shape ``[B, m, n]``.

    >>> import jax.numpy as jnp
    >>> to_matrices(jnp.zeros((2, 3, 4)), matrix_view((2, 3, 4))).shape
    (2, 3, 4)
    """
    if view.split is not None:
        x = x.reshape(view.shape)
    perm = view.batch_axes + view.reduction_axes + view.output_axes
    return jnp.transpose(x, perm).reshape(view.batch, view.m, view.n)


def from_matrices(y: jax.Array, view: MatrixView) -> jax.Array:
    """Inverse of :func:`to_matrices`: ``[B, m, n]`` back to the leaf's shape and axis order.

    Args:
      y: array of shape ``[B, m, n]``.
      view: the view used to build ``y``.

    Returns:
      Array of shape ``view.shape``.

    >>> import jax.numpy as jnp
    >>> view = matrix_view((3, 4, 5), MuonDimensionNumbers(0, 2))
    >>> x = jnp.arange(60.0).reshape(3, 4, 5)
    >>> bool((from_matrices(to_matrices(x, view), view) == x).all())
    True
    """
    perm = view.batch_axes + view.reduction_axes + view.output_axes
    permuted_shape = tuple(view.shape[a] for a in perm)
    inverse = tuple(sorted(range(len(perm)), key=lambda i: perm[i]))
    x = jnp.transpose(y.reshape(permuted_shape), inverse)
    return x if view.split is None else x.reshape(view.leaf_shape)


def shape_scale(m: int, n: int, mode: ShapeScaling) -> Any:
    r"""Factor applied to an orthogonalized ``[m, n]`` update (``m`` fan-in, ``n`` fan-out).

    .. math::
      \text{'spectral'}: \sqrt{\max(1, n / m)}, \quad
      \text{'spectral\_unclamped'}: \sqrt{n / m}, \quad
      \text{'rms\_match'}: 0.2 \sqrt{\max(m, n)}, \quad
      c: c \sqrt{\max(m, n)}, \quad \text{None}: 1.

    ``m`` is the product of the reduction axes and ``n`` of the output axes, so for a Flax kernel
    ``[in, out]`` (default dimension numbers) ``m = in`` and ``n = out``. ``torch.optim.Muon``
    reads ``A, B = weight.shape[:2]`` of a Linear weight ``[out, in]``: its ``'original'``
    ``sqrt(max(1, A / B))`` is ``'spectral'``, its ``'match_rms_adamw'`` is ``'rms_match'`` and
    its ``'spectral_unclamped'`` ``sqrt(A / B)`` is ``'spectral_unclamped'`` here.

    Args:
      m: fan-in (product of the reduction axes).
      n: fan-out (product of the output axes).
      mode: ``'spectral'`` (Jordan's width scaling, optax's default), ``'spectral_unclamped'``
        (the same without the clamp at 1: matrices with ``n < m`` are scaled down),
        ``'rms_match'`` (Moonlight: update RMS ~0.2 like AdamW, so AdamW learning rates and
        weight decay carry over), a number ``c`` (optax's ``consistent_rms``: ``'rms_match'``
        is 0.2; it may be a traced array) or ``None``.

    Returns:
      The factor: a Python float, or an array when ``mode`` is one.

    >>> shape_scale(4, 16, 'spectral'), shape_scale(16, 4, 'spectral')
    (2.0, 1.0)
    >>> shape_scale(16, 4, 'spectral_unclamped'), shape_scale(4, 16, 'rms_match')
    (0.5, 0.8)

    References:
      Liu et al., `Muon is Scalable for LLM Training <https://arxiv.org/abs/2502.16982>`_, 2025.
    """
    if mode is None:
        return 1.0
    if not isinstance(mode, str):
        return mode * math.sqrt(max(m, n))
    if mode == "spectral":
        return math.sqrt(max(1.0, n / m))
    if mode == "spectral_unclamped":
        return math.sqrt(n / m)
    if mode == "rms_match":
        return RMS_MATCH_FACTOR * math.sqrt(max(m, n))
    raise ValueError(
        f"shape_scaling={mode!r} is not supported; pass 'spectral', 'spectral_unclamped', "
        "'rms_match', a positive number c (c sqrt(max(m, n)), optax's consistent_rms) or None."
    )


def is_dim_nums_leaf(x: Any) -> bool:
    """Leaves of a dimension-numbers tree: dimension numbers, ``None`` or ``MaskedNode``.

    Example:
      >>> from optax.contrib import MuonDimensionNumbers
      >>> is_dim_nums_leaf(MuonDimensionNumbers()), is_dim_nums_leaf(None), is_dim_nums_leaf({})
      (True, True, False)
    """
    return x is None or isinstance(x, DIM_NUMS_TYPES + (optax.MaskedNode,))


def broadcast_prefix(
    prefix: Any, tree: Any, *, is_leaf: Callable[[Any], bool], name: str
) -> list[Any]:
    """Broadcast a prefix tree over ``tree``; one entry per leaf of ``tree``, in leaf order.

    Args:
      prefix: a tree whose structure is a prefix of ``tree``'s.
      tree: the full tree (params or updates).
      is_leaf: marks the prefix's leaves.
      name: the argument's name, for the error message.

    Returns:
      A list aligned with ``jax.tree.leaves(tree)``.

    >>> broadcast_prefix({'a': 1, 'b': 2}, {'a': [0, 0], 'b': 0}, is_leaf=lambda x: False,
    ...                  name='x')
    [1, 1, 2]
    """
    out: list[Any] = []

    def extend(p, sub):
        out.extend([p] * len(jax.tree.leaves(sub)))

    try:
        jax.tree.map(extend, prefix, tree, is_leaf=is_leaf)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"{name} must be a tree with the structure of the params (or a prefix of it), or a "
            f"callable on params returning one; for nnx.State params pass a callable. ({e})"
        ) from None
    return out


def resolve_dim_nums(
    dimension_numbers: DimNumsLike, tree: Any
) -> list[MuonDimensionNumbers | None]:
    """Per-leaf dimension numbers of ``tree`` (``None``: the default last-two-axes view).

    Args:
      dimension_numbers: ``None``, one ``MuonDimensionNumbers`` (or
        :class:`SplitDimensionNumbers`) for every leaf, a tree (prefix) of them with ``None`` /
        ``MaskedNode`` for "default", or a callable on the tree.
      tree: params or updates.

    Returns:
      A list aligned with ``jax.tree.leaves(tree)``.

    >>> resolve_dim_nums(None, {'w': 0, 'v': 0})
    [None, None]
    """
    n = len(jax.tree.leaves(tree))
    if dimension_numbers is None:
        return [None] * n
    if callable(dimension_numbers) and not isinstance(dimension_numbers, DIM_NUMS_TYPES):
        dimension_numbers = dimension_numbers(tree)
    if isinstance(dimension_numbers, DIM_NUMS_TYPES):
        return [dimension_numbers] * n
    flat = broadcast_prefix(dimension_numbers, tree, is_leaf=is_dim_nums_leaf,
                            name="dimension_numbers")
    return [None if isinstance(d, optax.MaskedNode) else d for d in flat]
