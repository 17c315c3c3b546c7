"""``optax.contrib.muon``'s API on muon_jax: the same names, arguments and defaults.

For code (and tests) written against ``optax.contrib``'s Muon: :func:`muon`,
:func:`scale_by_muon`, :func:`orthogonalize_via_newton_schulz`, :func:`compute_muon_reshape`
and ``MuonDimensionNumbers`` take optax 0.2.8's arguments with optax's defaults and meanings
(its routing: every 2-D leaf to Muon unless ``muon_weight_dimension_numbers`` says otherwise,
``None`` entries to AdamW; width scaling unless ``consistent_rms``; the iteration in the
updates' dtype; ``eps`` for Muon and AdamW; ``mu_dtype`` and ``nesterov`` for both, so the
AdamW part is NAdamW under ``nesterov=True``; per-step coefficient triples run all of them),
and run muon_jax's implementation. One keyword is added, ``sharding=``
(:class:`muon_jax.ShardingOptions`), so a port can shard without other changes. optax's own
Muon test file runs against this module (``tests/muon_jax/test_optax_port.py``), and
``optax.inject_hyperparams`` takes these functions without ``static_args``, as it takes
optax's.

The README's "Coming from optax.contrib.muon" table maps each argument to its
:func:`muon_jax.muon` spelling and says where the two defaults differ and why.

Example:
  >>> import jax.numpy as jnp
  >>> from muon_jax import optax_compat
  >>> tx = optax_compat.muon(learning_rate=1e-3)
  >>> params = {'w': jnp.ones((4, 8)), 'b': jnp.zeros(8)}
  >>> updates, _ = tx.update(params, tx.init(params), params)
  >>> sorted(updates)
  ['b', 'w']

References:
  ``optax.contrib.muon`` (optax 0.2.8), whose arguments and defaults this mirrors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from muon_jax import arguments, masking, matrices, newton_schulz, transform
from muon_jax.newton_schulz import NewtonSchulzOptions
from muon_jax.sharded_step import ShardingOptions

__all__ = ["MuonDimensionNumbers", "compute_muon_reshape", "muon",
           "orthogonalize_via_newton_schulz", "scale_by_muon"]

MuonDimensionNumbers = matrices.MuonDimensionNumbers


def _steps(ns_coeffs: Any, ns_steps: Any) -> tuple[Any, Any]:
    """optax's schedule rule: a name as is; ``T`` per-step triples run all ``T`` (``T <=
    ns_steps``, else an error, as optax); one triple ``ns_steps`` times. Traced values (under
    ``optax.inject_hyperparams``) pass through to the loop of :func:`muon_jax.orthogonalize`."""
    if not arguments.is_traced(ns_steps):
        arguments.check_number("ns_steps", ns_steps, low=1, fix="e.g. ns_steps=5.")
        ns_steps = int(ns_steps)
    if isinstance(ns_coeffs, str):
        if ns_coeffs not in ("standard", "dion"):
            raise ValueError(f"Unknown ns_coeffs preset string {ns_coeffs!r}; optax's presets "
                             "are 'standard' and 'dion' (or pass a triple or per-step triples).")
        if ns_coeffs == "dion":
            ns_coeffs = newton_schulz.DION_COEFFS
        else:
            return "jordan", ns_steps
    if arguments.is_traced(ns_coeffs):
        shape = tuple(np.shape(ns_coeffs))
        return ns_coeffs, shape[0] if len(shape) == 2 else ns_steps
    try:
        arr = np.asarray(ns_coeffs, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"ns_coeffs={ns_coeffs!r} is not a preset name, a triple (a, b, c) or "
                        "per-step triples; pass e.g. ns_coeffs=(3.4445, -4.775, 2.0315).") from None
    if arr.shape[-1:] != (3,) or arr.ndim not in (1, 2):
        raise ValueError(f"ns_coeffs has shape {arr.shape}; pass one triple (3,) or per-step "
                         "triples (T, 3).")
    if arr.ndim == 2:
        if not arguments.is_traced(ns_steps) and arr.shape[0] > ns_steps:
            raise ValueError(f"Not enough coeffs to perform {ns_steps} steps")
        return tuple(map(tuple, arr.tolist())), arr.shape[0]
    return tuple(arr.tolist()), ns_steps


def compute_muon_reshape(x: jax.Array, dim_nums: MuonDimensionNumbers
                         ) -> tuple[Callable[[jax.Array], jax.Array],
                                    Callable[[jax.Array], jax.Array]]:
    """``(reshape_fn, inverse_fn)``: ``x``'s leaf as ``[batch, reduction, output]`` matrices
    and back (`muon_jax.matrices.to_matrices` / `from_matrices` of its view).

    Example:
      >>> f, g = compute_muon_reshape(jnp.zeros((2, 3, 4)), MuonDimensionNumbers(0, 2))
      >>> f(jnp.zeros((2, 3, 4))).shape
      (3, 2, 4)
    """
    view = matrices.matrix_view(x.shape, dim_nums)
    return (lambda y: matrices.to_matrices(y, view)), (lambda y: matrices.from_matrices(y, view))


def orthogonalize_via_newton_schulz(
    x: jax.Array,
    ns_coeffs: jax.typing.ArrayLike,
    ns_steps: jax.typing.ArrayLike = 5,
    preconditioning: newton_schulz.Preconditioning = "frobenius",
    eps: float = 1e-8,
    dimension_numbers: MuonDimensionNumbers | None = None,
) -> jax.Array:
    """optax's ``orthogonalize_via_newton_schulz`` on :func:`muon_jax.orthogonalize`: one
    matrix, or a leaf with ``dimension_numbers``; float32 (complex64) matmuls.

    Example:
      >>> o = orthogonalize_via_newton_schulz(jnp.eye(3), jnp.array([2.0, -1.5, 0.5]), 10)
      >>> bool(jnp.allclose(o, jnp.eye(3), atol=1e-5))
      True
    """
    if x.ndim != 2 and not isinstance(dimension_numbers, MuonDimensionNumbers):
        raise ValueError(f"Input must have shape (m, n) or weight dimension numbers must be "
                         f"provided. Got shape={x.shape} and {dimension_numbers=}.")
    coeffs = np.asarray(ns_coeffs, dtype=np.float64)
    if coeffs.ndim > 2 or coeffs.shape[-1] != 3:
        raise ValueError(f"Newton-Schulz coefficients must have shape (3,) or (n, 3), got "
                         f"{coeffs.shape}")
    schedule, steps = _steps(coeffs, ns_steps if coeffs.ndim == 1 else len(coeffs))
    view = matrices.matrix_view(x.shape, None if x.ndim == 2 else dimension_numbers)
    o = newton_schulz.orthogonalize(matrices.to_matrices(x, view), ns_coeffs=schedule,
                                    ns_steps=steps, eps=eps, dtype=jnp.float32,
                                    preconditioning=preconditioning)
    return matrices.from_matrices(o, view)


def _two_d_default(dims: Any) -> Callable[[Any], Any]:
    """optax's routing callable: every 2-D leaf (``ndim == 2``) to Muon, or the entries of
    ``dims`` (``None``: AdamW)."""
    if dims is None:
        return lambda params: jax.tree.map(
            lambda x: MuonDimensionNumbers() if jnp.ndim(x) == 2 else None, params)
    return dims


def _check_adam_args(b1: Any, b2: Any, eps_root: Any, weight_decay: Any,
                     learning_rate: Any) -> None:
    """optax's AdamW arguments, checked under their own names."""
    for name, value, example in (("adam_b1", b1, 0.9), ("adam_b2", b2, 0.999)):
        arguments.check_number(name, value, low=0.0, high=1.0, high_open=True,
                               fix=f"e.g. {name}={example}.")
    arguments.check_number("adam_eps_root", eps_root, low=0.0, fix="e.g. adam_eps_root=0.0.")
    arguments.check_schedule("adam_weight_decay", weight_decay,
                             fix="e.g. adam_weight_decay=0.0 or a schedule.")
    if learning_rate is not None:
        arguments.check_schedule("adam_learning_rate", learning_rate,
                                 fix="e.g. adam_learning_rate=3e-4, a schedule or None.")


def _newton_schulz(adaptive: Any, preconditioning: Any) -> NewtonSchulzOptions:
    """optax's iteration: float32 matmuls (the updates' dtype), its preconditioning and
    ``adaptive``."""
    return NewtonSchulzOptions(dtype=jnp.float32, preconditioning=preconditioning,
                               adaptive=adaptive)


def scale_by_muon(
    ns_coeffs: Any = newton_schulz.JORDAN_COEFFS,
    ns_steps: jax.typing.ArrayLike = 5,
    beta: jax.typing.ArrayLike = 0.95,
    eps: jax.typing.ArrayLike = 1e-8,
    mu_dtype: jax.typing.DTypeLike | None = None,
    *,
    nesterov: bool = True,
    adaptive: bool = False,
    preconditioning: newton_schulz.Preconditioning = "frobenius",
    weight_dimension_numbers: Any = None,
    sharding: ShardingOptions | None = None,
) -> optax.GradientTransformation:
    """optax's ``scale_by_muon`` (no shape scaling; the iteration in the updates' dtype, as
    float32 matmuls): :func:`muon_jax.scale_by_muon` with ``shape_scaling=None``.

    Args are optax's (see ``optax.contrib.scale_by_muon``), and ``sharding``
    (:class:`muon_jax.ShardingOptions`) shards it.

    Example:
      >>> tx = scale_by_muon()
      >>> u, _ = tx.update({'w': jnp.eye(4)}, tx.init({'w': jnp.eye(4)}))
      >>> u['w'].shape
      (4, 4)
    """
    arguments.check_tree("weight_dimension_numbers", weight_dimension_numbers,
                         "MuonDimensionNumbers, a tree of them or a callable")
    schedule, steps = _steps(ns_coeffs, ns_steps)
    return transform.scale_by_muon(
        schedule, steps, beta, eps, mu_dtype, nesterov=nesterov, shape_scaling=None,
        dimension_numbers=weight_dimension_numbers,
        newton_schulz=_newton_schulz(adaptive, preconditioning), sharding=sharding)


def muon(
    learning_rate: optax.ScalarOrSchedule,
    ns_coeffs: Any = newton_schulz.JORDAN_COEFFS,
    ns_steps: jax.typing.ArrayLike = 5,
    beta: jax.typing.ArrayLike = 0.95,
    eps: jax.typing.ArrayLike = 1e-8,
    weight_decay: jax.typing.ArrayLike = 0.0,
    weight_decay_mask: Any = None,
    mu_dtype: jax.typing.DTypeLike | None = None,
    *,
    nesterov: bool = True,
    adaptive: bool = False,
    preconditioning: newton_schulz.Preconditioning = "frobenius",
    adam_b1: jax.typing.ArrayLike = 0.9,
    adam_b2: jax.typing.ArrayLike = 0.999,
    adam_eps_root: jax.typing.ArrayLike = 0.0,
    adam_weight_decay: jax.typing.ArrayLike = 0.0,
    adam_learning_rate: optax.ScalarOrSchedule | None = None,
    muon_weight_dimension_numbers: Any = None,
    consistent_rms: jax.typing.ArrayLike | None = None,
    sharding: ShardingOptions | None = None,
) -> optax.GradientTransformation:
    """``optax.contrib.muon``'s arguments and defaults on :func:`muon_jax.muon`.

    Args are optax's (see ``optax.contrib.muon``): every 2-D leaf goes to Muon unless
    ``muon_weight_dimension_numbers`` says otherwise (``None`` entries: AdamW), ``eps``,
    ``mu_dtype`` and ``nesterov`` serve both parts. ``sharding``
    (:class:`muon_jax.ShardingOptions`) shards it.

    Example:
      >>> tx = muon(1e-3, ns_coeffs="dion", consistent_rms=0.2)
      >>> u, _ = tx.update({'w': jnp.eye(4)}, tx.init({'w': jnp.eye(4)}), {'w': jnp.eye(4)})
      >>> u['w'].shape
      (4, 4)
    """
    # Checked here under optax's names: eps, mu_dtype and nesterov also set the AdamW part.
    arguments.check_number("eps", eps, low=0.0, fix="e.g. eps=1e-8.")
    arguments.float_dtype("mu_dtype", mu_dtype, none="the params' dtype")
    arguments.check_bool("nesterov", nesterov)
    _check_adam_args(adam_b1, adam_b2, adam_eps_root, adam_weight_decay, adam_learning_rate)
    if consistent_rms is not None:
        arguments.check_number("consistent_rms", consistent_rms, low=0.0, low_open=True,
                               fix="e.g. consistent_rms=0.2, or None (width scaling).")
    arguments.check_tree("muon_weight_dimension_numbers", muon_weight_dimension_numbers,
                         "MuonDimensionNumbers, a tree of them and None, or a callable")
    schedule, steps = _steps(ns_coeffs, ns_steps)
    dims = _two_d_default(muon_weight_dimension_numbers)
    adamw = transform.AdamWOptions(
        learning_rate=adam_learning_rate, b1=adam_b1, b2=adam_b2, eps=eps,
        eps_root=adam_eps_root, weight_decay=adam_weight_decay, nesterov=nesterov,
        mu_dtype=mu_dtype)
    return transform.muon(
        learning_rate, schedule, steps, beta, eps, weight_decay, mu_dtype=mu_dtype,
        nesterov=nesterov, shape_scaling="spectral" if consistent_rms is None else consistent_rms,
        muon_mask=masking.mask_from_dimension_numbers(dims), dimension_numbers=dims,
        weight_decay_mask=weight_decay_mask, adamw=adamw,
        newton_schulz=_newton_schulz(adaptive, preconditioning), sharding=sharding)
