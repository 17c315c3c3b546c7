"""Matrix views of known layers: which axes of a kernel are its inputs and outputs.

Muon orthogonalizes each kernel as the linear map it is, and a kernel's shape alone does not
say which map that is: ``nnx.MultiHeadAttention``'s query kernel ``[d_model, heads,
head_dim]`` is one ``[d_model, heads * head_dim]`` map, a conv kernel ``[kh, kw, c_in,
c_out]`` one ``[kh * kw * c_in, c_out]`` map, a layer stack ``[L, m, n]`` from ``nnx.scan`` /
``nnx.vmap`` ``L`` maps, and ``moe.MoE``'s fused bank ``w_gate_up [E, d, 2 f]`` ``2 E`` maps
``[d, f]`` (gate and up are separate projections, whose outputs only meet after the
nonlinearity: each gets its own orthogonal update, as when they are stored apart, and as
modded-nanogpt splits fused QKV). This module reads the views:

* from an NNX module graph (:func:`flax_dimension_numbers` on a module): ``nnx.Linear``,
  ``nnx.LinearGeneral`` (``nnx.MultiHeadAttention``'s projections), ``nnx.Einsum`` (from its
  equation), ``nnx.Conv`` / ``nnx.ConvTranspose`` (grouped convs: one matrix per group),
  and any layer that declares its views (:data:`VIEWS_METHOD`: ``moe.MoE`` does); axes a
  kernel has beyond its layer's own shape are stack axes (batch);
* from Linen param paths: auto-named ``Dense_N``, ``Conv_N``, ``ConvTranspose_N`` and the
  ``query``/``key``/``value``/``out`` kernels of ``MultiHeadDotProductAttention_N`` (a path
  cannot show where ``DenseGeneral``'s input axes end, nor stack axes before a conv's
  window, so those take explicit dimension numbers);
* from ``moe``'s bank names (``w_gate_up``, ``w_down``, ``shared_gate_up``, ``shared_down``)
  anywhere.

:func:`leaf_dimension_numbers` is what the transforms call at ``init``: explicit
``dimension_numbers`` win, then the layer's view, then the default (last two axes, leading axes
a batch), with a warning naming every leaf of rank >= 3 that gets the default. When the params
hold ``nnx.Variable`` objects (``nnx.Optimizer`` passes the model's own), the module graph is
found among the calling frames' locals and each variable confirmed by identity, so a view is
never taken from another model.
"""

from __future__ import annotations

import inspect
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax

from muon_jax import matrices

__all__ = ["flax_dimension_numbers", "leaf_dimension_numbers", "views_by_path"]

MDN = matrices.MuonDimensionNumbers
Split = matrices.SplitDimensionNumbers

# A layer's view of its own kernel: (expected shape, dimension numbers on that shape).
_OwnView = tuple[tuple[int, ...], Any]

VIEWS_METHOD = "matrix_views"
"""The method by which a layer declares its kernels' matrices (any NNX module may define it):
``layer.matrix_views() -> {attribute: (reduction_axes, output_axes, parts)}`` (an attribute
may be dotted, ``'qkv.kernel'``, for a sublayer's kernel), axes of the kernel as the layer
itself shapes it (stack axes that ``nnx.scan`` / ``nnx.vmap`` add are
found from the shapes), ``parts`` how many matrices lie side by side along the output axis (a
fused gate/up bank: 2). ``moe.MoE`` defines it; so can a user's layer."""

_LINEN_ATTENTION = re.compile(
    r"(MultiHeadDotProductAttention|MultiHeadAttention|SelfAttention)_\d+")
_LINEN_DENSE = re.compile(r"Dense_\d+")
_LINEN_CONV = re.compile(r"(Conv|ConvTranspose)_\d+")


def _nnx() -> Any:
    """``flax.nnx`` when it is loaded (NNX variables can exist only then), else ``None``."""
    return sys.modules.get("flax.nnx")


def _declared_views(layer: Any) -> dict[str, _OwnView]:
    """The views a layer declares with :data:`VIEWS_METHOD`, on its kernels' own shapes."""
    out = {}
    for name, (red, out_ax, parts) in getattr(layer, VIEWS_METHOD)().items():
        var = _attribute(layer, name)
        if var is None or not hasattr(var, "shape"):
            continue
        axes = [a for a in (*(red if isinstance(red, tuple) else (red,)),
                            *(out_ax if isinstance(out_ax, tuple) else (out_ax,)))]
        shape = tuple(var.shape)[len(var.shape) - 1 - max(axes):]
        out[name] = (shape, Split(red, out_ax, split_axis=out_ax, parts=parts) if parts > 1
                     else MDN(red, out_ax))
    return out


def _einsum_view(equation: str, kernel_shape: Sequence[int]) -> Any:
    """The kernel's view from ``'lhs,kernel->out'``: axes shared with the input only are the
    reduction, with the output only the output, with both a batch; ``None`` otherwise."""
    inputs, _, result = equation.partition("->")
    operands = inputs.split(",")
    if len(operands) != 2 or "." in inputs + result:
        return None
    lhs, rhs = operands
    if len(rhs) != len(kernel_shape) or len(set(rhs)) != len(rhs):
        return None
    red = tuple(i for i, c in enumerate(rhs) if c in lhs and c not in result)
    out = tuple(i for i, c in enumerate(rhs) if c in result and c not in lhs)
    if not red or not out or any(c not in lhs and c not in result for c in rhs):
        return None
    return MDN(red, out)


def _nnx_views(nnx: Any, layer: Any) -> dict[str, _OwnView]:
    """The kernels of one NNX layer of a known type, in the layer's own coordinates."""
    if callable(getattr(layer, VIEWS_METHOD, None)):
        return _declared_views(layer)
    if isinstance(layer, nnx.LinearGeneral):
        nb, ni = len(layer.batch_axis), len(layer.in_features)
        shape = (*layer.batch_axis.values(), *layer.in_features, *layer.out_features)
        return {"kernel": (shape, MDN(tuple(range(nb, nb + ni)),
                                      tuple(range(nb + ni, len(shape)))))}
    if isinstance(layer, nnx.Linear):
        return {"kernel": ((layer.in_features, layer.out_features), MDN(0, 1))}
    if isinstance(layer, nnx.Einsum):
        view = _einsum_view(layer.einsum_str, layer.kernel_shape)
        return {} if view is None else {"kernel": (tuple(layer.kernel_shape), view)}
    if isinstance(layer, nnx.Conv | nnx.ConvTranspose):
        size = layer.kernel_size
        size = (size,) if isinstance(size, int) else tuple(size)
        groups = getattr(layer, "feature_group_count", 1)
        shape = (*size, layer.in_features // groups, layer.out_features)
        red, out = tuple(range(len(size) + 1)), len(size) + 1
        view = MDN(red, out) if groups == 1 else Split(red, out, split_axis=out, parts=groups)
        return {"kernel": (shape, view)}
    return {}


def _stack_positions(actual: tuple[int, ...], own: tuple[int, ...]) -> tuple[int, ...] | None:
    """Where the extra (stack) axes of ``actual`` sit, so that the rest is ``own``: leading
    axes if they fit (``nnx.scan`` / ``nnx.vmap``'s default), else one other position that
    fits alone; ``None`` if the shapes do not fit or several positions do."""
    extra = len(actual) - len(own)
    if extra < 0:
        return None
    if actual[extra:] == own:
        return tuple(range(extra))
    if extra != 1:
        return None
    fits = [i for i in range(len(actual)) if actual[:i] + actual[i + 1:] == own]
    return (fits[0],) if len(fits) == 1 else None


def _placed(actual: tuple[int, ...], own_view: _OwnView) -> Any:
    """A layer's view of its own kernel, on the kernel as stored (stack axes: a batch)."""
    own, dims = own_view
    stack = _stack_positions(actual, tuple(own))
    if stack is None:
        return None
    keep = [i for i in range(len(actual)) if i not in stack]

    def lift(axes):
        return keep[axes] if isinstance(axes, int) else tuple(keep[a] for a in axes)

    if isinstance(dims, Split):
        return Split(lift(dims.reduction_axis), lift(dims.output_axis),
                     split_axis=lift(dims.split_axis), parts=dims.parts)
    return MDN(lift(dims.reduction_axis), lift(dims.output_axis))


def _graph_views(nnx: Any, root: Any) -> dict[int, tuple[Any, Any]]:
    """``id(variable) -> (variable, dimension numbers)`` for the known layers under ``root``
    (the variable is kept so its id stays its own). A view a module declares
    (:data:`VIEWS_METHOD`) wins over its sublayers' own, e.g. a fused QKV ``nnx.Linear``'s."""
    table, declared = {}, {}
    for _, node in nnx.iter_graph(root):
        if not isinstance(node, nnx.Module):
            continue
        own = callable(getattr(node, VIEWS_METHOD, None))
        for name, own_view in _nnx_views(nnx, node).items():
            var = _attribute(node, name)
            if isinstance(var, nnx.Variable):
                (declared if own else table)[id(var)] = (var, _placed(tuple(var.shape),
                                                                      own_view))
    return table | declared


def _attribute(node: Any, dotted: str) -> Any:
    """``node.a.b`` for ``'a.b'`` (None where an attribute is missing)."""
    for part in dotted.split("."):
        node = getattr(node, part, None)
    return node


def _path_view(path: Sequence[Any], shape: tuple[int, ...]) -> Any:
    """A view from a param's path alone: Linen's auto-named layers, moe's bank names."""
    keys = list(path)
    if keys and isinstance(keys[-1], jax.tree_util.GetAttrKey) and keys[-1].name == "value":
        keys = keys[:-1]  # an NNX variable's value
    names = matrices.path_str(keys).split("/")
    leaf, ndim = names[-1], len(shape)
    parent = names[-2] if len(names) > 1 else ""
    grand = names[-3] if len(names) > 2 else ""
    if leaf in ("w_gate_up", "shared_gate_up") and ndim >= 2 and shape[-1] % 2 == 0:
        return Split(ndim - 2, ndim - 1, split_axis=ndim - 1, parts=2)
    if leaf in ("w_down", "shared_down") and ndim >= 2:
        return MDN(ndim - 2, ndim - 1)
    if leaf != "kernel":
        return None
    if _LINEN_ATTENTION.fullmatch(grand) and ndim >= 3:
        if parent in ("query", "key", "value"):  # [..., d_model, heads, head_dim]
            return MDN(ndim - 3, (ndim - 2, ndim - 1))
        if parent == "out":  # [..., heads, head_dim, d_model]
            return MDN((ndim - 3, ndim - 2), ndim - 1)
    if _LINEN_DENSE.fullmatch(parent) and ndim >= 2:
        return MDN(ndim - 2, ndim - 1)
    if _LINEN_CONV.fullmatch(parent) and ndim >= 2:
        return MDN(tuple(range(ndim - 1)), ndim - 1)
    return None


def flax_dimension_numbers(model: Any) -> Any:
    """The dimension numbers of a Flax model's kernels, for ``dimension_numbers=``.

    For an NNX module: a tree like ``nnx.state(model, nnx.Param)`` holding, per kernel of a
    known layer (module docstring), the ``MuonDimensionNumbers`` (or
    :class:`muon_jax.SplitDimensionNumbers`) of its matrix view, and ``None`` elsewhere. For a
    Linen param tree (a dict): the same from its auto-named layers' paths.

    ``muon`` and ``scale_by_muon`` do this themselves when ``init`` sees the model's own
    variables; pass the result where it cannot (``init`` under ``jax.jit`` on plain arrays, a
    transform inside a user's ``optax.partition``).

    Args:
      model: an ``nnx.Module``, or a Linen param tree.

    Returns:
      A tree of dimension numbers and ``None``.

    >>> from flax import nnx
    >>> attn = nnx.MultiHeadAttention(num_heads=4, in_features=64, decode=False,
    ...                               rngs=nnx.Rngs(0))
    >>> dims = flax_dimension_numbers(attn)
    >>> dims['query']['kernel'], dims['out']['kernel'], dims['query']['bias']
    (MuonDimensionNumbers(reduction_axis=(0,), output_axis=(1, 2)), \
MuonDimensionNumbers(reduction_axis=(0, 1), output_axis=(2,)), None)
    """
    nnx = _nnx()
    if nnx is not None and isinstance(model, nnx.Module):
        table = _graph_views(nnx, model)
        return jax.tree.map(lambda v: table.get(id(v), (None, None))[1],
                            nnx.state(model, nnx.Param),
                            is_leaf=lambda x: isinstance(x, nnx.Variable))
    return jax.tree_util.tree_map_with_path(
        lambda path, x: _path_view(path, tuple(x.shape)), model)


def _caller_views(nnx: Any, wanted: set[int]) -> dict[int, Any]:
    """Views of the variables ``wanted`` (ids) from the NNX modules among the calling frames'
    locals: ``nnx.Optimizer.__init__`` holds its ``model``, a training script its own."""
    found: dict[int, Any] = {}
    seen: set[int] = set()
    frame = inspect.currentframe()
    try:
        for _ in range(64):
            if frame is None or wanted <= found.keys():
                break
            for value in list(frame.f_locals.values()):
                if isinstance(value, nnx.Module) and id(value) not in seen:
                    seen.add(id(value))
                    for key, (_, dims) in _graph_views(nnx, value).items():
                        if key in wanted:
                            found[key] = dims
            frame = frame.f_back
    finally:
        del frame
    return found


def _layer_views(params: Any) -> list[Any]:
    """Per leaf of ``params``, the view its layer gives it, or ``None``."""
    nnx = _nnx()
    is_var = (lambda x: isinstance(x, nnx.Variable)) if nnx is not None else None
    entries = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_var)[0]
    variables = {id(x) for _, x in entries if is_var is not None and is_var(x)}
    graph = _caller_views(nnx, variables) if variables else {}
    out = []
    for path, x in entries:
        leaves = jax.tree_util.tree_flatten_with_path(x)[0]
        for sub, leaf in leaves:
            shape = tuple(getattr(leaf, "shape", ()))
            view = graph.get(id(x)) if id(x) in variables else None
            out.append(view if view is not None else _path_view(tuple(path) + tuple(sub), shape))
    return out


def _warn_guessed(params: Any, guessed: list[int]) -> None:
    """One warning naming the leaves of rank >= 3 that get the default view, and the fix."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    names = [f"{matrices.path_str(flat[i][0])!r} {tuple(flat[i][1].shape)}" for i in guessed]
    listed = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    leaves, each = ("leaf", "it gets") if len(names) == 1 else (f"{len(names)} leaves",
                                                                 "each gets")
    warnings.warn(
        f"muon_jax: no layer gives the matrix view of Muon {leaves} {listed}: {each} the "
        "default, its last two axes the matrix and its leading axes a batch. If a leaf is one "
        "map over several axes (attention, conv) or fused, pass dimension_numbers= "
        "(muon_jax.flax_dimension_numbers(model) for a Flax model); "
        "MuonDimensionNumbers(-2, -1) at its path confirms the default.",
        UserWarning, stacklevel=4)


def leaf_dimension_numbers(params: Any, dimension_numbers: matrices.DimNumsLike = None, *,
                           muon_leaves: Sequence[bool] | None = None) -> list[Any]:
    """Per leaf of ``params``, the dimension numbers Muon views it with.

    The leaf's entry of ``dimension_numbers`` when it has one; else its layer's view
    (:func:`flax_dimension_numbers`, found from the params themselves); else ``None``, the
    default view, with one warning naming every Muon leaf of rank >= 3 left so.

    Args:
      params: the params as ``init`` gets them.
      dimension_numbers: explicit dimension numbers (a tree, prefix, callable or ``None``).
      muon_leaves: which leaves Muon updates (``None``: all); the others are neither read
        nor warned about.

    Returns:
      A list aligned with ``jax.tree.leaves(params)``.

    >>> import jax.numpy as jnp
    >>> leaf_dimension_numbers({'Conv_0': {'kernel': jnp.zeros((3, 3, 4, 8))}})
    [MuonDimensionNumbers(reduction_axis=(0, 1, 2), output_axis=3)]
    """
    explicit = matrices.resolve_dim_nums(dimension_numbers, params)
    flat = jax.tree.leaves(params)
    muon_leaves = [True] * len(flat) if muon_leaves is None else list(muon_leaves)
    need = [i for i, d in enumerate(explicit) if d is None and muon_leaves[i]]
    if not need:
        return explicit
    layer = _layer_views(params)
    out = [layer[i] if d is None and muon_leaves[i] else d for i, d in enumerate(explicit)]
    guessed = [i for i in need if out[i] is None and len(getattr(flat[i], "shape", ())) >= 3]
    if guessed:
        _warn_guessed(params, guessed)
    return out


def views_by_path(params: Any, dimension_numbers: matrices.DimNumsLike,
                  muon_leaves: Sequence[bool]) -> Callable[[Any], Any]:
    """``dimension_numbers`` for a copy of ``params`` that keeps their paths (what
    ``optax.partition`` hands its inner transforms): every Muon leaf's view resolved here by
    :func:`leaf_dimension_numbers` and made explicit, looked up by path.

    >>> import jax.numpy as jnp
    >>> params = {'w': jnp.zeros((4, 8)), 'b': jnp.zeros(8)}
    >>> views_by_path(params, None, [False, True])(params)
    {'b': None, 'w': MuonDimensionNumbers(reduction_axis=0, output_axis=1)}
    """
    dims = leaf_dimension_numbers(params, dimension_numbers, muon_leaves=muon_leaves)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    table = {}
    for (path, leaf), d, is_muon in zip(flat, dims, muon_leaves, strict=True):
        ndim = len(getattr(leaf, "shape", ()))
        if is_muon and d is None and ndim >= 2:  # the default, now explicit: not warned twice
            d = MDN(ndim - 2, ndim - 1)
        table[tuple(path)] = d
    return lambda tree: jax.tree_util.tree_map_with_path(lambda p, _: table.get(tuple(p)), tree)
