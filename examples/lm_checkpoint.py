"""Checkpoints of examples/train_lm.py: orbax save / restore and the resume message.

Params, the MoE balancing biases and the optimizer state are saved shard by shard; sharded
Muon momentum goes in its mesh-independent form (``muon_jax.portable_state``), so a run may
resume on another ``--mesh``.
"""

from __future__ import annotations

import json
import pathlib

import jax
from flax import nnx

import muon_jax

KEEP_CHECKPOINTS = 2
"""Checkpoints kept per run by default (the newest ones; ``--keep-checkpoints``)."""


def manager(path: pathlib.Path, keep: int = KEEP_CHECKPOINTS):
    """An orbax ``CheckpointManager`` under ``path`` keeping the newest ``keep`` steps (0:
    every one)."""
    import orbax.checkpoint as ocp

    opts = ocp.CheckpointManagerOptions(max_to_keep=keep or None, create=True)
    return ocp.CheckpointManager(path.resolve(), options=opts)


_to_portable = jax.jit(muon_jax.portable_state)
_from_portable = jax.jit(muon_jax.restore_state)


def save(mngr, step, model, optimizer, mesh):
    """Saves params, the MoE balancing biases and the optimizer state, each shard in place.

    Sharded Muon momentum is saved in its mesh-independent form (each matrix's momentum in its
    param's layout), so ``--resume`` also works after ``--mesh`` changes. The mesh each step
    was saved on goes to ``meshes.json`` next to the checkpoints (for the resume message).
    """
    import orbax.checkpoint as ocp

    state = {
        "model": nnx.state(model),
        "step": optimizer.step[...],
        "opt_state": _to_portable(nnx.as_pure(optimizer.opt_state)),
    }
    mngr.save(step, args=ocp.args.StandardSave(state))
    if jax.process_index() == 0:
        side = pathlib.Path(mngr.directory) / "meshes.json"
        meshes = json.loads(side.read_text()) if side.exists() else {}
        meshes[str(step)] = dict(mesh.shape)
        side.write_text(json.dumps(meshes))


def restore(mngr, model, optimizer) -> int:
    """Loads the latest checkpoint into ``model`` and ``optimizer``; returns its step (0: none)."""
    import orbax.checkpoint as ocp

    step = mngr.latest_step()
    if step is None:
        return 0
    template = nnx.as_pure(optimizer.opt_state)
    abstract = {
        "model": jax.tree.map(ocp.utils.to_shape_dtype_struct, nnx.state(model)),
        "step": ocp.utils.to_shape_dtype_struct(optimizer.step[...]),
        "opt_state": muon_jax.portable_target(template),
    }
    restored = mngr.restore(step, args=ocp.args.StandardRestore(abstract))
    nnx.update(model, restored["model"])
    optimizer.step[...] = restored["step"]
    nnx.update(optimizer.opt_state, nnx.state(_from_portable(restored["opt_state"], template)))
    return int(step)


def resume_message(name: str, mngr, step: int, mesh) -> str:
    """Where ``--resume`` continues from: step, checkpoint path and any mesh change."""
    directory = pathlib.Path(mngr.directory)
    if step == 0:
        return f"[{name}] --resume: no checkpoint under {directory}; starting at step 0."
    side = directory / "meshes.json"
    saved = json.loads(side.read_text()).get(str(step)) if side.exists() else None
    now = dict(mesh.shape)
    if saved is None:
        where = f"mesh now {now}"
    elif saved == now:
        where = f"same mesh {now}"
    else:
        where = f"saved on mesh {saved}, now {now}: Muon state re-laid out"
    return f"[{name}] resumed at step {step} from {directory / str(step)} ({where})."
