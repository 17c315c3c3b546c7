"""Which leaves Muon updates: the default routing rule and user overrides.

Muon is for hidden-layer matrices. Everything else (embeddings, the output head, biases, norm
scales, vectors and scalars) goes to AdamW. The rule reads each leaf's rank, dtype and key-path
names, so it works the same on plain dicts and on ``nnx.State`` (where paths look like
``('layers', 'mlp', 'kernel', 'value')``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np

from muon_jax import matrices

MaskLike: TypeAlias = Any  # tree (or prefix) of bools, or callable on params returning one

ADAMW_EXACT_NAMES: frozenset[str] = frozenset(
    {"head", "lm_head", "output_head", "classifier", "wte", "wpe", "bias", "scale"}
)
"""Key names (any path component, compared lower-case) that send a leaf to AdamW: output
heads (``head``, ``lm_head``, ``output_head``, ``classifier``), GPT-2's token and position
tables (``wte``, ``wpe``), biases and norm scales (``bias``, ``scale``; also stacked ones of
rank 2)."""

ADAMW_NAME_PARTS: tuple[str, ...] = ("embed", "norm")
"""Substrings of a path component that send a leaf to AdamW: ``embed`` (``embed``,
``embedding``, ``embeddings``, ``embed_tokens``, ``tok_embeddings``, ``unembed``,
``pos_embedding``, ...) and ``norm`` (``norm``, ``layernorm``, ``rms_norm``, ...)."""


def _names(path: Any) -> list[str]:
    """Lower-case key names of a leaf path."""
    return [p.lower() for p in matrices.path_str(path).split("/")]


def _is_float(leaf: Any) -> bool:
    """Whether ``leaf`` has a float or complex dtype (Muon orthogonalizes complex matrices in
    complex64, as optax does)."""
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def default_rule(path: Any, leaf: Any, has_dim_nums: bool = False) -> bool:
    """The default routing of one leaf: ``True`` for Muon, ``False`` for AdamW.

    Args:
      path: the leaf's JAX key path.
      leaf: an array (or anything with ``shape`` and ``dtype``).
      has_dim_nums: whether explicit dimension numbers were given for the leaf.

    Returns:
      Whether Muon updates the leaf.

    >>> import jax.numpy as jnp
    >>> from jax.tree_util import DictKey
    >>> default_rule((DictKey('mlp'), DictKey('kernel')), jnp.zeros((4, 8)))
    True
    >>> default_rule((DictKey('embed'), DictKey('embedding')), jnp.zeros((4, 8)))
    False
    """
    if not _is_float(leaf):
        return False
    if has_dim_nums:
        return True
    shape = tuple(getattr(leaf, "shape", ()))
    if len(shape) < 2 or sum(d > 1 for d in shape) <= 1:
        return False  # a vector in any view ([1, n], [n, 1], 1x1): Newton-Schulz would
        # only normalize it (a 1x1 to its sign), with none of a matrix's geometry
    for name in _names(path):
        if name in ADAMW_EXACT_NAMES or any(part in name for part in ADAMW_NAME_PARTS):
            return False
    return True


def default_muon_mask(params: Any, *, dimension_numbers: matrices.DimNumsLike = None) -> Any:
    """Tree of bools: ``True`` where Muon updates the leaf, ``False`` where AdamW does.

    A float leaf goes to Muon when it has explicit dimension numbers of its own (an entry of a
    tree, or of what a callable returns), or when it has rank >= 2 and no path component names
    an embedding, head, bias or norm (see :data:`ADAMW_EXACT_NAMES` and
    :data:`ADAMW_NAME_PARTS`) and more than one of its axes is longer than 1. Everything else
    (embeddings, the output head, biases, norm scales, 1-D and scalar leaves, vectors stored
    as ``[1, n]`` / ``[n, 1]`` matrices such as a ``[d, 1]`` gate, non-float leaves) goes to
    AdamW: Newton-Schulz would only normalize a vector (a ``1 x 1`` matrix to its sign). One
    ``MuonDimensionNumbers`` for the whole tree (e.g. the torch layout of every matrix) is a
    view of the leaves Muon updates and routes nothing: a bias or an embedding still goes to
    AdamW and is never checked against it.

    MoE router kernels (``[d_model, E]``) are hidden matrices here and go to Muon, although
    several recipes keep them on AdamW: with this repository's trainer
    (``examples/train_lm.py --router-optimizer muon|adamw``) the router on Muon ended at a
    lower validation loss on both presets. To put routers on AdamW, pass a mask that is this
    one with the router leaves set to ``False``.

    Args:
      params: a tree of arrays: a plain dict, an ``nnx.State`` (with or without ``Variable``
        nodes), or any pytree.
      dimension_numbers: optional dimension numbers (a ``MuonDimensionNumbers``, a tree/prefix
        of them, or a callable on params); leaves with non-``None`` entries go to Muon.

    Returns:
      A tree of bools with the structure of ``params``.

    >>> import jax.numpy as jnp
    >>> default_muon_mask({'embed': jnp.zeros((8, 4)), 'w': jnp.zeros((4, 4)),
    ...                    'b': jnp.zeros((4,)), 'gate': jnp.zeros((4, 1))})
    {'b': False, 'embed': False, 'gate': False, 'w': True}
    >>> torch_layout = matrices.MuonDimensionNumbers(reduction_axis=1, output_axis=0)
    >>> default_muon_mask({'w': jnp.zeros((4, 4)), 'b': jnp.zeros((4,))},
    ...                   dimension_numbers=torch_layout)
    {'b': False, 'w': True}

    References:
      Jordan et al., `Muon: An optimizer for hidden layers in neural networks
      <https://kellerjordan.github.io/posts/muon/>`_, 2024.
    """
    # One set for every leaf is a view, not a routing: only per-leaf entries route to Muon.
    routing = None if isinstance(dimension_numbers, matrices.DIM_NUMS_TYPES) \
        else dimension_numbers
    flat_dims = matrices.resolve_dim_nums(routing, params)
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
    flags = [
        default_rule(path, leaf, d is not None)
        for (path, leaf), d in zip(leaves_with_path, flat_dims, strict=True)
    ]
    return jax.tree.unflatten(treedef, flags)


def resolve_muon_mask(
    muon_mask: MaskLike | None, params: Any, *, dimension_numbers: matrices.DimNumsLike = None
) -> list[bool]:
    """Per-leaf Muon flags of ``params``: the user mask if given, else the default rule.

    Args:
      muon_mask: ``None`` (use :func:`default_muon_mask`), a tree (or prefix) of bools, or a
        callable on params returning one. A user mask replaces the default rule entirely.
      params: the tree to route.
      dimension_numbers: forwarded to :func:`default_muon_mask`.

    Returns:
      A list of bools aligned with ``jax.tree.leaves(params)``.

    >>> resolve_muon_mask(lambda p: {'a': False, 'b': True}, {'a': 0.0, 'b': 0.0})
    [False, True]
    """
    if muon_mask is None:
        mask = default_muon_mask(params, dimension_numbers=dimension_numbers)
    elif isinstance(muon_mask, Callable):  # type: ignore[arg-type]
        mask = muon_mask(params)
    else:
        mask = muon_mask
    is_flag = lambda x: isinstance(x, bool | np.bool_)
    flat = matrices.broadcast_prefix(mask, params, is_leaf=is_flag, name="muon_mask")
    for f in flat:
        if not is_flag(f):
            raise TypeError(
                f"muon_mask leaves must be Python bools (True: Muon, False: AdamW), got {f!r}."
            )
    return [bool(f) for f in flat]


def mask_from_dimension_numbers(dimension_numbers: Any) -> Callable[[Any], Any]:
    """A ``muon_mask`` callable from optax-style ``muon_weight_dimension_numbers``: a leaf
    goes to Muon where its entry is a ``MuonDimensionNumbers``, to AdamW where it is ``None``.

    Args:
      dimension_numbers: one ``MuonDimensionNumbers``, a tree (prefix) of them and ``None``,
        or a callable on params returning one.

    Returns:
      A callable on params returning a tree of bools.

    >>> import jax.numpy as jnp
    >>> dn = matrices.MuonDimensionNumbers()
    >>> mask_from_dimension_numbers({'w': dn, 'v': None})({'w': jnp.ones((2, 2)),
    ...                                                   'v': jnp.ones((2, 2))})
    {'v': False, 'w': True}
    """

    def mask(params):
        flat = matrices.resolve_dim_nums(dimension_numbers, params)
        return jax.tree.unflatten(jax.tree.structure(params), [d is not None for d in flat])

    return mask
