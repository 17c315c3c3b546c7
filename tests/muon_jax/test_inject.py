"""optax's conventions: ``optax.inject_hyperparams`` takes muon_jax's transforms with no
``static_args``, unsharded and on Auto and Explicit meshes, and changing a hyperparameter
between steps (learning rate, weight decay, beta, and the step count Newton-Schulz then runs in
a loop) gives the update of the transform built with the new values, from the same state."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import muon_jax
from muon_jax import optax_compat

F32 = muon_jax.NewtonSchulzOptions(dtype=jnp.float32)
RNG = np.random.default_rng(0)
SHAPES = {"w": (16, 24), "v": (24, 16), "b": (16,)}
PARAMS, G1, G2 = ({k: RNG.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
                  for _ in range(3))
MATRICES = ("w", "v")

# name: (factory, static keywords, hyperparameters before and after the change). Few
# Newton-Schulz steps (3, then 2): the plumbing is the point here, not the iteration
# (test_orthogonalize, test_gram_ns and test_optax_port prove it), and the reference built
# with the new values unrolls them all.
TRANSFORMS = {
    "muon": (muon_jax.muon, dict(newton_schulz=F32),
             dict(learning_rate=0.02, weight_decay=0.1, beta=0.9, ns_steps=3),
             dict(learning_rate=0.05, weight_decay=0.3, beta=0.5, ns_steps=2)),
    "scale_by_muon": (muon_jax.scale_by_muon, dict(newton_schulz=F32),
                      dict(beta=0.9, ns_steps=3), dict(beta=0.5, ns_steps=2)),
    "optax_compat.muon": (optax_compat.muon, {},
                          dict(learning_rate=0.02, weight_decay=0.1, beta=0.9, ns_steps=3),
                          dict(learning_rate=0.05, weight_decay=0.3, beta=0.5, ns_steps=2)),
    "optax_compat.scale_by_muon": (optax_compat.scale_by_muon, {}, dict(beta=0.9, ns_steps=3),
                                   dict(beta=0.5, ns_steps=2)),
}


def _mesh(kind):
    if kind is None:
        return None
    return jax.make_mesh((8,), ("d",), axis_types=(kind,))


@pytest.mark.parametrize("kind", [None, AxisType.Auto, AxisType.Explicit],
                         ids=["no_mesh", "auto", "explicit"])
@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_inject_hyperparams_without_static_args(name, kind):
    factory, static, before, after = TRANSFORMS[name]
    mesh = _mesh(kind)
    if mesh is not None:
        static = {**static, "sharding": muon_jax.ShardingOptions(mesh)}
    keys = SHAPES if "learning_rate" in before else MATRICES  # scale_by_muon: matrices only

    def place(tree):
        tree = {k: jnp.asarray(tree[k]) for k in keys}
        return tree if mesh is None else jax.device_put(tree, NamedSharding(mesh, P()))

    params, g1, g2 = place(PARAMS), place(G1), place(G2)
    tx = optax.inject_hyperparams(factory)(**before, **static)
    # Explicit axes: a jitted init (one program, not one per op); else eager (on Auto axes
    # the specs are read from the placed arrays).
    state = (jax.jit(tx.init) if kind == AxisType.Explicit else tx.init)(params)
    update = jax.jit(tx.update)
    _, state = update(g1, state, params)
    for k, v in after.items():  # the injected values are state: no recompilation
        state.hyperparams[k] = jnp.asarray(v, state.hyperparams[k].dtype)
    got, new_state = update(g2, state, params)
    ref = factory(**after, **static)  # the same step, built with the new values
    want, _ = jax.jit(ref.update)(g2, state.inner_state, params)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
    if "learning_rate" in after:  # a zero learning rate: a zero update
        state.hyperparams["learning_rate"] = jnp.zeros_like(state.hyperparams["learning_rate"])
        zero, _ = update(g2, state, params)
        assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(zero))
