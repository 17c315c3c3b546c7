"""Checks of public arguments where they enter: each error names the argument, its value and the
fix.

Numbers may arrive traced: ``optax.inject_hyperparams`` turns every int and float argument into
an array of its state and rebuilds the transform from it on each update, under ``jax.jit``.
A traced value cannot be read, so only its shape and dtype are checked there; concrete ones
(Python and NumPy numbers, concrete JAX arrays) are checked in full, which covers the
``init`` of an injected transform (its hyperparameters are concrete then).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["check_bool", "check_number", "check_schedule", "check_tree", "float_dtype",
           "is_traced"]


def is_traced(x: Any) -> bool:
    """Whether ``x`` is a tracer (its value unknown while a function is traced).

    >>> seen = []
    >>> _ = jax.jit(lambda x: seen.append(is_traced(x)))(1.0)
    >>> is_traced(1.0), is_traced(jnp.ones(())), seen
    (False, False, [True])
    """
    return isinstance(x, jax.core.Tracer)


def _is_scalar_number(value: Any) -> bool:
    """A real number: Python int/float (not bool), or a 0-d NumPy/JAX integer or float array."""
    if isinstance(value, bool | np.bool_):
        return False
    if isinstance(value, int | float):
        return True
    dtype = getattr(value, "dtype", None)
    return (dtype is not None and np.ndim(value) == 0
            and (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)))


def check_number(name: str, value: Any, *, low: float | None = None,
                 high: float | None = None, low_open: bool = False, high_open: bool = False,
                 integer: bool = False, fix: str = "") -> None:
    """Raise unless ``value`` is a finite real number in ``[low, high]`` (a bound excluded
    with ``low_open`` / ``high_open``); an integer with ``integer``. Traced scalars pass on
    dtype alone.

    Args:
      name: the argument, as the caller spells it.
      value: its value.
      low: the smallest value allowed (``None``: no bound).
      high: the largest value allowed (``None``: no bound).
      low_open: exclude ``low`` itself.
      high_open: exclude ``high`` itself.
      integer: require an integer (a float such as ``5.0`` is refused).
      fix: what to pass instead, appended to the message.

    Raises:
      TypeError: ``value`` is not a real scalar (or not an integer when one is needed).
      ValueError: it is not finite or out of range.

    >>> check_number('beta', 1.5, low=0.0, high=1.0, high_open=True, fix='e.g. beta=0.95.')
    Traceback (most recent call last):
    ...
    ValueError: beta=1.5 is out of range [0.0, 1.0); pass e.g. beta=0.95.
    """
    fix = f"; pass {fix}" if fix else "."
    kind = "an integer" if integer else "a real number"
    if not _is_scalar_number(value):
        raise TypeError(f"{name}={value!r} ({type(value).__name__}) is not {kind}{fix}")
    if integer and not (isinstance(value, int) or jnp.issubdtype(value.dtype, jnp.integer)):
        raise TypeError(f"{name}={value!r} ({type(value).__name__}) is not {kind}{fix}")
    if is_traced(value):
        return
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name}={value!r} is not finite{fix}")
    too_low = low is not None and (v <= low if low_open else v < low)
    too_high = high is not None and (v >= high if high_open else v > high)
    if too_low or too_high:
        lo = "(-inf" if low is None else f"({low}" if low_open else f"[{low}"
        hi = "inf)" if high is None else f"{high})" if high_open else f"{high}]"
        raise ValueError(f"{name}={value!r} is out of range {lo}, {hi}{fix}")


def check_schedule(name: str, value: Any, *, fix: str = "") -> None:
    """Raise unless ``value`` is a finite number ``>= 0`` or a callable (an optax schedule).

    >>> check_schedule('learning_rate', 'x', fix='e.g. 0.02.')  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    TypeError: learning_rate='x' (str) is not a real number or a schedule; pass e.g. 0.02.
    """
    if callable(value):
        return
    if not _is_scalar_number(value):
        raise TypeError(f"{name}={value!r} ({type(value).__name__}) is not a real number or a "
                        f"schedule{'; pass ' + fix if fix else '.'}")
    check_number(name, value, low=0.0, fix=fix)


def check_bool(name: str, value: Any) -> None:
    """Raise ``TypeError`` unless ``value`` is a bool.

    >>> check_bool('nesterov', 'yes')
    Traceback (most recent call last):
    ...
    TypeError: nesterov='yes' (str) is not a bool; pass True or False.
    """
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name}={value!r} ({type(value).__name__}) is not a bool; pass True or "
                        "False.")


def check_tree(name: str, value: Any, what: str) -> None:
    """Raise ``TypeError`` for a tree-or-callable argument that is a number or a string, which
    can be neither (``what``: what it should be).

    >>> check_tree('muon_mask', 'all', 'a tree of bools or a callable on params')
    Traceback (most recent call last):
    ...
    TypeError: muon_mask='all' (str) is not a tree of bools or a callable on params.
    """
    if isinstance(value, str | int | float | np.number) and not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} ({type(value).__name__}) is not {what}.")


def float_dtype(name: str, value: Any, *, none: str | None = None,
                extra: tuple[str, ...] = ()) -> Any:
    """``value`` as a float ``numpy.dtype``; ``None`` (when ``none`` says what it means) and
    the strings in ``extra`` pass through unchanged.

    Args:
      name: the argument, as the caller spells it.
      value: a dtype, its name, ``None`` or one of ``extra``.
      none: what ``None`` means (``None``: ``None`` is refused).
      extra: other strings accepted as they are (e.g. ``'auto'``).

    Returns:
      The canonical dtype, or ``value`` itself (``None`` or one of ``extra``).

    Raises:
      TypeError: ``value`` is not a float dtype (nor an accepted ``None`` / string).

    >>> float_dtype('mu_dtype', 'bfloat16'), float_dtype('mu_dtype', None, none='the params')
    (dtype(bfloat16), None)
    >>> float_dtype('ns_dtype', 'int32')
    Traceback (most recent call last):
    ...
    TypeError: ns_dtype='int32' is not a float dtype; pass jnp.bfloat16 or jnp.float32.
    """
    if value is None and none is not None:
        return None
    if isinstance(value, str) and value in extra:
        return value
    try:
        dt = jnp.dtype(value) if value is not None else None
    except TypeError:  # not a dtype at all, e.g. a misspelled name
        dt = None
    if dt is None or not jnp.issubdtype(dt, jnp.floating):
        options = [repr(e) for e in extra] + ["jnp.bfloat16", "jnp.float32"]
        options += [f"None ({none})"] if none is not None else []
        # optax.inject_hyperparams calls a dtype class (a callable) as a schedule: the
        # transform then gets an array where the dtype was.
        hint = (" (under optax.inject_hyperparams give dtypes as strings, e.g. 'bfloat16', "
                "or in static_args)" if isinstance(value, jax.Array | np.ndarray) else "")
        shown = value.__name__ if isinstance(value, type) else repr(value)
        raise TypeError(f"{name}={shown} is not a float dtype; pass "
                        f"{', '.join(options[:-1])} or {options[-1]}{hint}.")
    return dt
