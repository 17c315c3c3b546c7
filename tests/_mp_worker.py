"""One of two processes (4 CPU devices each) joined by jax.distributed over loopback; run by
tests/integration/test_multiprocess.py:

    python tests/_mp_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR

Trains tests/_tiny_moe.py's model for a few steps on the global (2, 4) ('data', 'expert')
mesh: each step is an expert-parallel MoE forward/backward (all-to-all dispatch over
'expert') and a sharded Muon update (owner stacks split over all 8 devices). Process 0
writes the losses, params, balancing biases and Muon momentum (gathered to the host only for
the comparison) to OUT_DIR/result.npz.
"""

import os
import sys

PROCESS_ID, NUM_PROCESSES, PORT, OUT_DIR = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                            sys.argv[4])
LOCAL_DEVICES = 8 // NUM_PROCESSES
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={LOCAL_DEVICES}"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{PORT}",
    num_processes=NUM_PROCESSES,
    process_id=PROCESS_ID,
    initialization_timeout=120,
)
if tuple(int(v) for v in jax.__version__.split(".")[:2]) >= (0, 12):
    # As examples/train_lm.py does: jax 0.12's CPU processes hang in the first step when every
    # program comes from the persistent compilation cache (the run after a cold one), so these
    # workers compile instead.
    jax.config.update("jax_enable_compilation_cache", False)

import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

_TESTS = os.path.dirname(os.path.abspath(__file__))
# tests/ has a folder named moe (the package's tests): the repository root goes first, so that
# `import moe` finds the package rather than that folder (a namespace package).
sys.path[:0] = [os.path.dirname(_TESTS), _TESTS]
import _tiny_moe as tm  # noqa: E402

STEPS = 3


def main() -> None:
    assert jax.process_count() == NUM_PROCESSES and jax.device_count() == 8, jax.devices()
    assert jax.local_device_count() == LOCAL_DEVICES
    mesh = tm.make_mesh((2, 4))
    (_, params, bias, opt_state, _), losses = tm.run(mesh, STEPS)
    mu = opt_state.inner_states["muon"].inner_state[0].mu
    # Every process holds only its devices' shards of the sharded leaves.
    w = params["blocks"][0]["moe"]["w_gate_up"][...]
    assert not w.is_fully_addressable and len(w.addressable_shards) == LOCAL_DEVICES
    host = multihost_utils.process_allgather(
        {"params": params, "bias": bias, "mu": mu}, tiled=True)
    if PROCESS_ID == 0:
        flat = {jax.tree_util.keystr(p): np.asarray(x)
                for p, x in jax.tree_util.tree_flatten_with_path(host)[0]}
        flat["losses"] = np.asarray(losses)
        np.savez(os.path.join(OUT_DIR, "result.npz"), **flat)
    multihost_utils.sync_global_devices("done")
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
