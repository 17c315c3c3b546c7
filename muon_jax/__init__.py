"""muon_jax: the Muon optimizer for Optax, sharded ZeRO-1 style under jax.sharding meshes."""

from optax.contrib import MuonDimensionNumbers

from muon_jax._masking import default_muon_mask
from muon_jax._newton_schulz import ns_flops, orthogonalize, resolve_ns_coeffs
from muon_jax._transform import MuonState, muon, scale_by_muon

__all__ = [
    "MuonDimensionNumbers",
    "MuonState",
    "default_muon_mask",
    "muon",
    "ns_flops",
    "orthogonalize",
    "resolve_ns_coeffs",
    "scale_by_muon",
]
