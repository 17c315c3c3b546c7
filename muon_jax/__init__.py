"""muon_jax: the Muon optimizer for Optax, sharded ZeRO-1 style under jax.sharding meshes."""

from optax.contrib import MuonDimensionNumbers

from muon_jax import loss_scale
from muon_jax._masking import default_muon_mask
from muon_jax._newton_schulz import ns_flops, orthogonalize, resolve_ns_coeffs
from muon_jax._transform import MuonState, ShardedMuonState, muon, scale_by_muon
from muon_jax.dp import reduce_unreduced, reduced_view
from muon_jax.portable import PortableMuonState, portable_state, portable_target, restore_state

__all__ = [
    "loss_scale",
    "MuonDimensionNumbers",
    "MuonState",
    "PortableMuonState",
    "ShardedMuonState",
    "default_muon_mask",
    "muon",
    "ns_flops",
    "orthogonalize",
    "portable_state",
    "portable_target",
    "reduce_unreduced",
    "reduced_view",
    "resolve_ns_coeffs",
    "restore_state",
    "scale_by_muon",
]
