"""muon_jax: the Muon optimizer for Optax, sharded ZeRO-1 style under jax.sharding meshes.

The top level holds what a training script calls, with its option objects
(:class:`NewtonSchulzOptions`, :class:`ShardingOptions`, :class:`AdamWOptions`); the building
blocks stay in their modules: :mod:`muon_jax.newton_schulz` (schedules, the standard and Gram
forms, FLOP counts), :mod:`muon_jax.symmetric` (symmetric products from one triangle: row
strips, the tile kernel), :mod:`muon_jax.matrices` (leaves as ``[B, m, n]`` batches, shape
scaling), :mod:`muon_jax.layouts` (the matrix views of Flax layers and moe's banks),
:mod:`muon_jax.arguments` (argument checks), :mod:`muon_jax.masking` (routing),
:mod:`muon_jax.sharded_step` (the update on a mesh),
:mod:`muon_jax.owner_plan` and :mod:`muon_jax.owners` (sharded owner compute),
:mod:`muon_jax.dp` (unreduced data-parallel gradients), :mod:`muon_jax.portable` (checkpoints),
:mod:`muon_jax.loss_scale` and :mod:`muon_jax.optax_compat` (``optax.contrib.muon``'s API and
defaults on this implementation).
"""

from optax.contrib import MuonDimensionNumbers

from muon_jax import loss_scale, optax_compat
from muon_jax.dp import clip_by_global_norm, reduce_unreduced, reduced_view
from muon_jax.layouts import flax_dimension_numbers
from muon_jax.masking import default_muon_mask
from muon_jax.matrices import SplitDimensionNumbers
from muon_jax.newton_schulz import GramOptions, NewtonSchulzOptions, orthogonalize
from muon_jax.portable import PortableMuonState, portable_state, portable_target, restore_state
from muon_jax.sharded_step import ShardingOptions
from muon_jax.transform import AdamWOptions, MuonState, ShardedMuonState, muon, scale_by_muon

__all__ = [
    "loss_scale",
    "optax_compat",
    "AdamWOptions",
    "GramOptions",
    "MuonDimensionNumbers",
    "MuonState",
    "NewtonSchulzOptions",
    "PortableMuonState",
    "ShardedMuonState",
    "ShardingOptions",
    "SplitDimensionNumbers",
    "clip_by_global_norm",
    "default_muon_mask",
    "flax_dimension_numbers",
    "muon",
    "orthogonalize",
    "portable_state",
    "portable_target",
    "reduce_unreduced",
    "reduced_view",
    "restore_state",
    "scale_by_muon",
]
