"""The Mixture-of-Experts layer as a Flax NNX module: :class:`MoE` owns the parameters and
the balancing bias (:class:`BalancingBias`) and calls :func:`moe.moe_apply`."""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.extend.core import concrete_or_error
from jax.sharding import PartitionSpec as P

from moe import meshes
from moe import routing as _routing
from moe.layer import moe_apply
from moe.options import MoEOptions

__all__ = ["BalancingBias", "MoE"]

# The functional core compiled once per static options, mesh, shapes and dtypes: a layer called
# outside any jit runs this instead of op-by-op dispatch (seconds per call for a small layer).
# Under grad / vjp / jvp outside a jit, jax differentiates this call as one jit equation, so the
# forward, the linearized and the transposed programs are each compiled once and cached (op by
# op, one nnx.grad of a small layer is ~600 compilations, 15-25 s on 2 CPU cores, every call).
# Not inline=True: under grad its linear part would be inlined into the linearized jaxpr that
# jax's backward pass then evaluates equation by equation, op by op again.
_eager_apply = jax.jit(moe_apply, static_argnames=("options", "mesh"))


def _staged(tree) -> bool:
    """Whether a leaf has no concrete value: staged into a jaxpr (jit, scan, remat) or batched.

    JVP / linearize tracers outside any jit carry concrete primals: those calls go through
    ``_eager_apply`` too. ``concrete_or_error`` is jax.extend's public form of that test (the
    tracer classes and the trace stack are private and move between jax versions).
    """
    for leaf in jax.tree.leaves(tree):
        try:
            concrete_or_error(None, leaf)
        except jax.errors.ConcretizationTypeError:
            return True
    return False


def _check_float_dtype(name: str, value: Any) -> None:
    """TypeError naming ``name`` unless ``value`` is a floating-point dtype (or its name)."""
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        shown = value if dtype is None else dtype.name
        raise TypeError(f"{name} must be a floating-point dtype, got {shown!r}; e.g. "
                        f"{name}=jnp.bfloat16 or jnp.float32.")


@nnx.register_variable_name("balancing_bias", overwrite=True)  # Linen collection name
class BalancingBias(nnx.Variable):
    """Aux-loss-free balancing bias (DeepSeek-V3): changes expert selection, never trained.

    Example:
      >>> from flax import nnx
      >>> from moe import MoE, MoEOptions
      >>> layer = nnx.eval_shape(lambda: MoE(16, 8, options=MoEOptions.create(4, 2),
      ...                                        rngs=nnx.Rngs(0)))
      >>> nnx.state(layer, BalancingBias)['balancing_bias'].shape
      (4,)
      >>> 'balancing_bias' in nnx.state(layer, nnx.Param)  # not trained
      False
    """


class MoE(nnx.Module):
    """Expert-parallel Mixture-of-Experts feed-forward layer (gated experts, top-k router).

    ``y = sum_{j<k} w_j(x) * E_{e_j}(x) + S(x)`` where the router picks ``e_j`` by
    ``top_k(score(x W_r + b_r) + bias)``, ``E_e(x) = act(x Wgu_e + bgu_e) Wd_e + bd_e``
    (``act([g | u]) = silu(g) * u`` by default) and ``S`` is the optional always-on shared
    expert (DeepSeekMoE), optionally gated by ``sigmoid(x w_g)`` (Qwen2-MoE). Experts are split
    over the mesh's expert axis and tokens over every mesh axis; tokens travel to their experts
    by ``all_to_all`` (optionally as FP8 e4m3 with E8M0 block scales). Every static choice
    lives in ``options``; the params the options ask for (``router_bias``, ``b_gate_up`` /
    ``b_down``, ``shared_gate``) exist only when enabled.

    Training and eval: like ``nnx.Dropout``, the layer has a ``deterministic`` attribute
    (False: training) that ``.eval()`` / ``.train()`` and ``nnx.view`` set; only the router
    jitter (``router_jitter_noise > 0``) depends on it, drawing its noise from the ``'jitter'``
    stream of ``rngs`` (or its default stream).

    Args:
      d_model: model width.
      d_ff: hidden width of one expert.
      options: a :class:`moe.MoEOptions` (``moe.MoEOptions.create(num_experts, top_k, ...)``).
      mesh: mesh (default: the ambient ``jax.set_mesh`` mesh, else one device).
      dtype: compute dtype; param_dtype: parameter dtype.
      rngs: ``nnx.Rngs`` (keyword-only).

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from moe import MoE, MoEOptions
      >>> layer = MoE(16, 8, options=MoEOptions.create(4, 2), rngs=nnx.Rngs(0))
      >>> y, aux = nnx.jit(lambda layer, x: layer(x))(layer, jnp.ones((2, 4, 16)))
      >>> y.shape, aux['tokens_per_expert'].shape
      ((2, 4, 16), (4,))

    References:
      Shazeer et al. 2017; GShard; Switch Transformer; DeepSeekMoE; DeepSeek-V3 (aux-free
      balancing, group-limited routing); DeepEP (FP8 dispatch).
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        options: MoEOptions,
        mesh=None,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ):
        if not isinstance(options, MoEOptions):
            raise TypeError(
                f"options must be a moe.MoEOptions, got {type(options).__name__}; build it "
                "with moe.MoEOptions.create(num_experts, top_k, ...)."
            )
        options.check(d_model=d_model, d_ff=d_ff, mesh=meshes.resolve(mesh))
        for name, value in (("dtype", dtype), ("param_dtype", param_dtype)):
            _check_float_dtype(name, value)
        if not isinstance(rngs, nnx.Rngs):
            raise TypeError(f"rngs must be an nnx.Rngs, got {type(rngs).__name__}; pass "
                            "rngs=nnx.Rngs(0).")
        self.mesh = mesh
        self.dtype = dtype
        self.options = options
        self.deterministic = False
        self._init_params(d_model, d_ff, param_dtype, rngs)
        if options.router.router_jitter_noise > 0:
            try:
                self.jitter_rngs = rngs["jitter"].fork()
            except KeyError:
                raise ValueError(
                    "router_jitter_noise > 0 draws noise from rngs['jitter'], which this Rngs "
                    "lacks; pass nnx.Rngs(0) (a default stream) or nnx.Rngs(params=0, "
                    "jitter=1)."
                ) from None
        else:
            self.jitter_rngs = None

    def _init_params(self, d_model: int, d_ff: int, param_dtype, rngs: nnx.Rngs) -> None:
        """Router, expert banks (split over the expert axis), shared expert, balancing bias."""
        mesh, e = self.mesh, self.options.router.num_experts
        axis = self.options.dispatch.expert_axis
        # With an explicit mesh, place the values here (``reshard`` / a sharding constraint):
        # ``jax.set_mesh`` is refused under a trace, and ``moe_linen`` builds the module inside
        # ``apply``, often under ``jax.jit``. With only an ambient mesh, flax places them.
        eager = mesh is None and meshes.resolve(mesh) is not None
        # Banks whose expert count does not split over the expert axis stay whole on every
        # device (moe_apply pads and splits them per call).
        ambient = meshes.resolve(mesh)
        split = ambient is None or e % math.prod(
            ambient.shape[a] for a in self.options.dispatch.expert_axes) == 0
        ax = axis if split else None

        def place(value, sharding):
            return value if mesh is None else meshes.reshard(value, mesh, P(*sharding))

        def param(key, shape, fan_in, sharding):
            value = jax.random.normal(key, shape, param_dtype) * fan_in**-0.5
            return nnx.Param(place(value, sharding), out_sharding=sharding,
                             eager_sharding=eager)

        def zeros(shape, sharding):
            return nnx.Param(place(jnp.zeros(shape, param_dtype), sharding),
                             out_sharding=sharding, eager_sharding=eager)

        experts = self.options.experts
        self.router_kernel = param(rngs.params(), (d_model, e), d_model, (None, None))
        self.w_gate_up = param(rngs.params(), (e, d_model, 2 * d_ff), d_model, (ax, None, None))
        self.w_down = param(rngs.params(), (e, d_ff, d_model), d_ff, (ax, None, None))
        # Each attribute is assigned once: a None first would make it a static field.
        if experts.num_shared_experts:
            f = experts.num_shared_experts * d_ff
            self.shared_gate_up = param(rngs.params(), (d_model, 2 * f), d_model, (None, None))
            self.shared_down = param(rngs.params(), (f, d_model), f, (None, None))
        else:
            self.shared_gate_up = self.shared_down = None
        if experts.shared_expert_gate:
            self.shared_gate = param(rngs.params(), (d_model, 1), d_model, (None, None))
        else:
            self.shared_gate = None
        self.router_bias = zeros((e,), (None,)) if self.options.router.router_bias else None
        if experts.expert_bias:
            self.b_gate_up = zeros((e, 2 * d_ff), (ax, None))
            self.b_down = zeros((e, d_model), (ax, None))
        else:
            self.b_gate_up = self.b_down = None
        self.balancing_bias = BalancingBias(
            place(jnp.zeros((e,), jnp.float32), (None,)), out_sharding=(None,),
            eager_sharding=eager,
        )

    @property
    def opts(self) -> MoEOptions:
        """The former name of :attr:`options`, deprecated."""
        warnings.warn("MoE.opts is deprecated; read MoE.options (the same MoEOptions).",
                      DeprecationWarning, stacklevel=2)
        return self.options

    def __call__(
        self, x: jax.Array, mask: jax.Array | None = None, *, deterministic: bool | None = None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Returns ``(y, aux)`` for ``x [batch, seq, d_model]``; see :func:`moe_apply`.

        Called outside a jit, the layer runs its functional core compiled (once per options,
        mesh, shapes and dtypes), so only the first call of a shape pays the compilation, and
        the same holds for its gradients (``nnx.grad`` / ``jax.vjp`` outside a jit run compiled
        forward and backward programs); inside ``jax.jit`` / ``nnx.jit`` it is part of the
        caller's program.

        Args:
          x: ``[batch, seq, d_model]``.
          mask: optional bool ``[batch, seq]``, False for padding tokens (excluded from
            routing, capacity, counts and losses; their ``y`` is 0).
          deterministic: overrides the ``deterministic`` attribute (True: no router jitter).
        """
        shared = None
        if self.shared_gate_up is not None:
            shared = (self.shared_gate_up[...], self.shared_down[...])
        value = lambda v: None if v is None else v[...]  # noqa: E731
        expert_bias = None
        if self.b_gate_up is not None:
            expert_bias = (self.b_gate_up[...], self.b_down[...])
        if deterministic is not None and not isinstance(deterministic, bool):
            raise TypeError(f"deterministic must be True, False or None, got {deterministic!r}.")
        deterministic = self.deterministic if deterministic is None else deterministic
        key = None
        if self.jitter_rngs is not None and not deterministic:
            key = self.jitter_rngs()
        kwargs = dict(x=jnp.asarray(x).astype(self.dtype), router_kernel=self.router_kernel[...],
                      w_gate_up=self.w_gate_up[...], w_down=self.w_down[...],
                      bias=self.balancing_bias[...], shared=shared,
                      router_bias=value(self.router_bias), expert_bias=expert_bias,
                      shared_gate=value(self.shared_gate), token_mask=mask, jitter_key=key)
        # Inside a jit (or vmap, scan) the caller's trace compiles the layer; called eagerly or
        # under grad outside a jit, the layer compiles itself once per shapes (the ambient mesh
        # resolved first, so a later jax.set_mesh gets its own compilation). Either way
        # moe_apply resolves the options against the call once.
        if _staged(kwargs):
            return moe_apply(options=self.options, mesh=self.mesh, **kwargs)
        return _eager_apply(options=self.options, mesh=meshes.resolve(self.mesh), **kwargs)

    def matrix_views(self) -> dict[str, tuple[int, int, int]]:
        """The linear maps each kernel holds: ``{attribute: (input axis, output axis, parts)}``
        on the kernel's own axes, ``parts`` the maps side by side along the output axis.

        ``w_gate_up [E, d_model, 2 d_ff]`` holds ``2 E`` maps ``[d_model, d_ff]`` (the gate's
        and the up projection's columns, whose outputs meet only after the nonlinearity),
        ``w_down [E, d_ff, d_model]`` ``E`` maps, the shared experts' kernels one or two, the
        router kernel one. For optimizers that treat kernels as matrices (``muon_jax`` reads
        this method when it meets the layer's variables).

        Example:
          >>> from flax import nnx
          >>> layer = MoE(64, 32, options=MoEOptions.create(4, 2), rngs=nnx.Rngs(0))
          >>> layer.matrix_views()["w_gate_up"]
          (1, 2, 2)
        """
        views = {"router_kernel": (0, 1, 1), "w_gate_up": (1, 2, 2), "w_down": (1, 2, 1)}
        if self.shared_gate_up is not None:
            views.update(shared_gate_up=(0, 1, 2), shared_down=(0, 1, 1))
        return views

    def set_view(self, deterministic: bool | None = None):
        """Sets the view attributes of ``nnx.view`` (and ``.eval()`` / ``.train()``).

        Args:
          deterministic: True turns the router jitter off (eval), False on (training).
        """
        if deterministic is not None:
            self.deterministic = deterministic

    def update_balancing_bias(self, tokens_per_expert: jax.Array, rate: float = 1e-3) -> None:
        """Aux-loss-free balancing step: ``bias += rate * sign(mean_load - load)``.

        Args:
          tokens_per_expert: ``[num_experts]`` slots per expert, ``aux['tokens_per_expert']``.
          rate: the bias update speed, a number ``>= 0`` (DeepSeek-V3: 1e-3, then 0), or an
            array (e.g. a schedule's value under ``jit``).
        """
        number = isinstance(rate, numbers.Real) and not isinstance(rate, bool)
        if not (number or isinstance(rate, (jax.Array, np.ndarray))):
            raise TypeError(f"rate must be a number or an array, got {rate!r}.")
        if number and not 0 <= rate < math.inf:
            raise ValueError(f"rate must be a finite number >= 0, got {rate!r}; DeepSeek-V3 "
                             "uses 1e-3.")
        self.balancing_bias[...] = _routing.update_balancing_bias(
            self.balancing_bias[...], tokens_per_expert, rate
        )
