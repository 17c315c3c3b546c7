"""xla_comm: what a compiled JAX program communicates, and XLA flags to overlap it.

`xla_comm.parse` reads HLO text into computations and instructions; `xla_comm.hlo` reads the
collectives of an HLO module (kind, bytes, group size, ring cost,
while-loop membership, overlap with compute); `xla_comm.overlap` builds the XLA:GPU options
that let async collectives overlap compute; `xla_comm.schedule` replays a compiled schedule in
time (exposed communication predicted) under `xla_comm.costs`' cost and link models;
`xla_comm.latency` hands those modeled times to XLA's scheduler (a latency profile) and
compiles again; `xla_comm.trace` reads `jax.profiler` traces (collective
time left exposed by compute) and `xla_comm.breakdown` their device time per op category and
named-scope region.
Both packages of this distribution (`muon_jax`, `moe`), their tests, benchmarks and notebooks
use them.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from xla_comm import hlo
  >>> rep = hlo.analyze_collectives(jax.jit(jnp.sin).lower(jnp.ones(4)).compile())
  >>> len(rep)
  0
"""

from xla_comm import breakdown, costs, hlo, latency, overlap, parse, schedule, trace

__all__ = ["breakdown", "costs", "hlo", "latency", "overlap", "parse", "schedule", "trace"]
