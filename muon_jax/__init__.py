"""muon_jax: the Muon optimizer for Optax, sharded ZeRO-1 style under jax.sharding meshes."""
