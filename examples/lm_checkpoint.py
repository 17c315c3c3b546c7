"""Checkpoints of examples/train_lm.py: orbax save / restore, the checks before a run touches
them, and the resume message.

Params, the MoE balancing biases and the optimizer state are saved shard by shard; sharded
Muon momentum goes in its mesh-independent form (``muon_jax.portable_state``), so a run may
resume on another ``--mesh``. Next to each optimizer's checkpoints, ``settings.json`` records
per step the flags that fix what a checkpoint holds (:func:`settings`) and ``meshes.json`` the
mesh it was saved on. :func:`check_checkpoints` compares the record with a command line before
JAX starts, so a ``--resume`` that cannot fit is refused in one line naming the flags.

JAX, Flax and orbax are imported inside the functions that save and restore: the checks run
before the trainer imports them.
"""

from __future__ import annotations

import functools
import json
import pathlib

from lm_flags import KEEP_CHECKPOINTS, UsageError  # noqa: F401  (KEEP_CHECKPOINTS: re-export)

MODEL_SETTINGS = ("d_model", "layers", "heads", "d_ff", "experts", "tie_embeddings")
"""Flags a checkpoint must be resumed with: they fix the params' shapes (and, ``heads``, how
attention splits them). Others (``--top-k``, ``--dtype``, the FP8 recipes, ``--mesh``, the
batch, the schedule) change how training continues, not what the checkpoint holds."""
MUON_SETTINGS = ("router_optimizer",)
"""The Muon run's too: which part of Muon's state holds the router kernels."""
SETTINGS_FILE = "settings.json"
MESHES_FILE = "meshes.json"


def settings(name: str, args) -> dict:
    """What a checkpoint of optimizer ``name`` records of ``args`` (and is checked against)."""
    keys = MODEL_SETTINGS + (MUON_SETTINGS if name == "muon" else ())
    return {k: getattr(args, k) for k in keys}


def run_names(args) -> list[str]:
    """The optimizers a command line trains, in order."""
    return ["muon", "adamw"] if args.optimizer == "both" else [args.optimizer]


def saved_steps(directory: pathlib.Path) -> list[int]:
    """The steps checkpointed under ``directory`` (orbax's step folders), ascending."""
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir())


def _read(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _record(directory: pathlib.Path, file: str, step: int, value) -> None:
    path = directory / file
    records = _read(path)
    records[str(step)] = value
    path.write_text(json.dumps(records))


def recorded_settings(directory: pathlib.Path, step: int) -> dict | None:
    """The settings the checkpoint of ``step`` was saved with; ``None`` for one saved before the
    trainer recorded them."""
    return _read(directory / SETTINGS_FILE).get(str(step))


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _value(key: str, value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def check_checkpoints(args) -> None:
    """Raises :class:`UsageError` (one line) when the checkpoints under ``--out`` do not fit the
    run asked for: a ``--resume`` whose latest checkpoint was trained with other model flags
    (:func:`settings`; checkpoints saved before they were recorded are checked by
    :func:`restore`), a ``--resume`` finding only another optimizer's checkpoints, or a fresh run
    that would save its checkpoints among an earlier run's (orbax skips a step that is not
    past the latest saved one, so the earlier run's would be resumed later). Reads JSON only:
    runs before JAX starts."""
    root = pathlib.Path(args.out) / "ckpt"
    names = run_names(args)
    latest = {n: saved_steps(root / n)[-1:] for n in names}
    if not args.resume:
        held = [f"{n} at step {s[0]}" for n, s in latest.items() if s]
        if held and args.ckpt_every:
            raise UsageError(
                f"--out {args.out} already holds an earlier run's checkpoints "
                f"({', '.join(held)}): pass --resume to continue it, or another --out (or "
                f"delete {root}) to start fresh.")
        return
    if not any(latest.values()):
        others = [n for n in ("muon", "adamw") if n not in names and saved_steps(root / n)]
        if others:
            raise UsageError(
                f"--resume: --out {args.out} holds checkpoints of {' and '.join(others)}, not of "
                f"--optimizer {args.optimizer}: pass --optimizer {others[0]} to resume them, or "
                "another --out to start fresh.")
        return
    differ, where = {}, []
    for name, steps in latest.items():
        if not steps:
            continue
        saved = recorded_settings(root / name, steps[0])
        if saved is None:
            continue
        asked = settings(name, args)
        diffs = {k: v for k, v in saved.items() if k in asked and asked[k] != v}
        if diffs:
            differ.update(diffs)
            where.append(str(root / name / str(steps[0])))
    if differ:
        trained = ", ".join(f"{_flag(k)} {_value(k, v)} (asked: {_value(k, getattr(args, k))})"
                            for k, v in differ.items())
        passes = [f"{_flag(k)}{'' if v is True else f' {v}'}" for k, v in differ.items()
                  if v is not False]
        drops = [_flag(k) for k, v in differ.items() if v is False]
        fix = " and ".join(part for part in (
            "pass " + " ".join(passes) if passes else "",
            "leave out " + " ".join(drops) if drops else "") if part)
        them = "it" if len(where) == 1 else "them"
        what = (f"the checkpoint {where[0]} does not fit the run asked for: it was"
                if len(where) == 1 else
                f"the checkpoints {' and '.join(where)} do not fit the run asked for: they were")
        raise UsageError(f"--resume: {what} trained with {trained}. To resume {them}, {fix}; "
                         "or start fresh with another --out.")


@functools.cache
def _portable_jits():
    import jax

    import muon_jax

    return jax.jit(muon_jax.portable_state), jax.jit(muon_jax.restore_state)


def manager(path: pathlib.Path, keep: int = KEEP_CHECKPOINTS):
    """An orbax ``CheckpointManager`` under ``path`` keeping the newest ``keep`` steps (0:
    every one)."""
    import orbax.checkpoint as ocp

    opts = ocp.CheckpointManagerOptions(max_to_keep=keep or None, create=True)
    # The handler named up front, so item_metadata can read a checkpoint before restoring it.
    return ocp.CheckpointManager(path.resolve(), options=opts,
                                 item_handlers=ocp.StandardCheckpointHandler())


def save(mngr, step, model, optimizer, mesh, record: dict | None = None) -> bool:
    """Saves params, the MoE balancing biases and the optimizer state, each shard in place;
    returns whether orbax saved (it skips a step not past its latest).

    Sharded Muon momentum is saved in its mesh-independent form (each matrix's momentum in its
    param's layout), so ``--resume`` also works after ``--mesh`` changes. The mesh each step
    was saved on goes to ``meshes.json`` next to the checkpoints (for the resume message), and
    ``record`` (:func:`settings`) to ``settings.json`` (for :func:`check_checkpoints`).
    """
    import jax
    import orbax.checkpoint as ocp
    from flax import nnx

    to_portable, _ = _portable_jits()
    state = {
        "model": nnx.state(model),
        "step": optimizer.step[...],
        "opt_state": to_portable(nnx.as_pure(optimizer.opt_state)),
    }
    saved = mngr.save(step, args=ocp.args.StandardSave(state))
    if saved and jax.process_index() == 0:
        directory = pathlib.Path(mngr.directory)
        _record(directory, MESHES_FILE, step, dict(mesh.shape))
        if record is not None:
            _record(directory, SETTINGS_FILE, step, record)
    return bool(saved)


def restore(mngr, model, optimizer) -> int:
    """Loads the latest checkpoint into ``model`` and ``optimizer``; returns its step (0: none).

    A checkpoint saved before its settings were recorded (so :func:`check_checkpoints` could
    not compare them) that does not fit ``model`` raises :class:`UsageError` in one line."""
    import jax
    import orbax.checkpoint as ocp
    from flax import nnx

    import muon_jax

    step = mngr.latest_step()
    if step is None:
        return 0
    template = nnx.as_pure(optimizer.opt_state)
    abstract = {
        "model": jax.tree.map(ocp.utils.to_shape_dtype_struct, nnx.state(model)),
        "step": ocp.utils.to_shape_dtype_struct(optimizer.step[...]),
        "opt_state": muon_jax.portable_target(template),
    }
    directory = pathlib.Path(mngr.directory)
    legacy = recorded_settings(directory, step) is None

    def refuse(why: str) -> UsageError:
        mngr.close()  # no orbax threads left to fail at exit
        return UsageError(
            f"--resume: the checkpoint {directory / str(step)} does not fit the run asked for "
            f"({why}); it was saved before checkpoints recorded their flags. To resume it, pass "
            "the flags it was trained with (its run's summary.json lists them under 'args'); or "
            "start fresh with another --out.")

    if legacy and (why := _shape_mismatch(mngr, step, abstract)):
        raise refuse(why)  # before orbax's restore, which fails noisily on a wrong shape
    try:
        restored = mngr.restore(step, args=ocp.args.StandardRestore(abstract))
    except Exception as e:
        if not legacy:
            mngr.close()
            raise
        raise refuse((str(e).strip().splitlines() or [type(e).__name__])[0]
                     .split(". ")[0].rstrip(":.")) from None
    _, from_portable = _portable_jits()
    nnx.update(model, restored["model"])
    optimizer.step[...] = restored["step"]
    nnx.update(optimizer.opt_state, nnx.state(from_portable(restored["opt_state"], template)))
    return int(step)


def _shapes(tree) -> dict[str, tuple]:
    """``{'model/blocks/0/...': shape}`` of a tree of arrays or of orbax's array metadata."""
    import jax

    def key(k):
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                return str(getattr(k, attr))
        return str(k)

    return {"/".join(key(k) for k in path): tuple(x.shape)
            for path, x in jax.tree_util.tree_leaves_with_path(tree) if hasattr(x, "shape")}


def _shape_mismatch(mngr, step: int, abstract) -> str | None:
    """The first array whose shape (or presence) differs between the checkpoint of ``step``
    and ``abstract``; ``None`` if all match or orbax cannot say (its restore then decides)."""
    try:
        stored = mngr.item_metadata(step)
        stored = _shapes(getattr(stored, "tree", stored))
    except Exception:  # an orbax without item metadata: leave it to restore
        return None
    wanted = _shapes(abstract)
    if not stored:
        return None
    for name in sorted(stored.keys() | wanted.keys()):
        there, here = stored.get(name), wanted.get(name)
        if there != here:
            return (f"{name} is {'absent' if there is None else there} there, "
                    f"{'absent' if here is None else here} here")
    return None


def resume_message(name: str, mngr, step: int, mesh) -> str:
    """Where ``--resume`` continues from: step, checkpoint path and any mesh change."""
    directory = pathlib.Path(mngr.directory)
    if step == 0:
        return f"[{name}] --resume: no checkpoint under {directory}; starting at step 0."
    saved = _read(directory / MESHES_FILE).get(str(step))
    now = dict(mesh.shape)
    if saved is None:
        where = f"mesh now {now}"
    elif saved == now:
        where = f"same mesh {now}"
    else:
        where = f"saved on mesh {saved}, now {now}: Muon state re-laid out"
    return f"[{name}] resumed at step {step} from {directory / str(step)} ({where})."
