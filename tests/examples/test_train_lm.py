"""The trainer (examples/train_lm.py): outputs, presets, exact resume, and one-line errors."""

import contextlib
import io
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
import types

import jax
import numpy as np
import pytest
from _paths import ROOT
from flax import nnx

EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))

import lm_checkpoint  # noqa: E402
import lm_flags  # noqa: E402
import lm_metrics  # noqa: E402
import lm_model  # noqa: E402
import train_lm  # noqa: E402

# A tiny configuration: seconds per run on 8 simulated CPU devices.
TINY = [
    "--d-model", "64", "--layers", "1", "--heads", "2", "--d-ff", "32", "--experts", "4",
    "--batch", "8", "--seq-len", "16", "--eval-batches", "1", "--max-corpus-mb", "0.5",
    "--fp8-block-size", "16", "--warmup", "2", "--no-progress",
]

def _abstract_model(cfg):
    """The model's structure, options and parameter shapes without running its initializers
    (each an eager op that compiles): what the tests that only read them need."""
    return nnx.eval_shape(lambda: lm_model.TransformerLM(cfg, rngs=nnx.Rngs(0)))


# What describe() reads of a corpus, without loading one.
_Corpus = types.SimpleNamespace(train=np.zeros(1000, np.uint8), val=np.zeros(100, np.uint8),
                                num_train_files=1, num_val_files=1, root="stdlib")


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """``cli(*flags)``: the trainer run as a command whose heavy imports (JAX, Flax, Optax,
    orbax, NumPy) fail, so whatever it reports came before them; a CompletedProcess."""
    stubs = tmp_path_factory.mktemp("no_heavy_imports")
    for name in ("jax", "flax", "optax", "orbax", "numpy"):
        (stubs / name).mkdir()
        (stubs / name / "__init__.py").write_text(
            f"raise ImportError('{name} imported before the command line was checked')\n")
    env = {**os.environ, "PYTHONPATH": str(stubs)}

    def run(*flags):
        return subprocess.run([sys.executable, str(EXAMPLES / "train_lm.py"), *flags],
                              capture_output=True, text=True, timeout=60, env=env)

    return run


def _one_line_error(proc) -> str:
    """The single stderr line of a refused command line (exit status 2)."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr)
    assert lines[0].startswith("train_lm.py: error: ")
    return lines[0].removeprefix("train_lm.py: error: ")


def _checkpoints(out: pathlib.Path, name: str) -> list[int]:
    """The steps of ``name``'s checkpoints kept under ``out``."""
    return sorted(int(p.name) for p in (out / "ckpt" / name).iterdir() if p.name.isdigit())


def _losses(out: pathlib.Path, name: str) -> list[tuple[int, float]]:
    recs = lm_metrics.read_metrics(out / "metrics.jsonl")
    return [(r["step"], r["train_loss"]) for r in recs if r["optimizer"] == name]


def test_trainer_writes_metrics_plot_and_summary(tmp_path, capsys):
    """Also --keep-checkpoints 1: the newest checkpoint per optimizer alone is kept (0 keeps
    all: test_resume_continues_exactly's uninterrupted run; the default is 2)."""
    out = tmp_path / "run"
    rc = train_lm.main([*TINY, "--optimizer", "both", "--steps", "4", "--eval-every", "1",
                        "--ckpt-every", "2", "--keep-checkpoints", "1", "--peak-tflops", "0.5",
                        "--out", str(out)])
    assert rc == 0
    for name in ("muon", "adamw"):
        assert _checkpoints(out, name) == [4]
    assert train_lm.parse_args(TINY).keep_checkpoints == lm_checkpoint.KEEP_CHECKPOINTS == 2
    text = capsys.readouterr().out
    assert "bits/byte" in text and ("beats" in text or "trails" in text)
    recs = lm_metrics.read_metrics(out / "metrics.jsonl")
    assert {r["optimizer"] for r in recs} == {"muon", "adamw"}
    assert [r["step"] for r in recs if r["optimizer"] == "muon"] == [1, 2, 3, 4]
    assert all(r["train_loss"] > 0 and r["tokens_per_s"] > 0 for r in recs)
    assert any("val_loss" in r for r in recs)
    png = (out / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["results"]) == {"muon", "adamw"}
    assert summary["mesh"] == {"data": 2, "expert": 4}
    cfg = train_lm.model_config(train_lm.parse_args(TINY))
    for name, r in summary["results"].items():
        assert r["steps_run"] == 4 and r["tokens"] == 4 * 8 * 16
        assert r["flops_per_token"] == lm_model.train_flops_per_token(cfg, 16)
        # MFU = model FLOPs per second over the peak of the 8 devices (0.5 TFLOP/s each).
        want = r["flops_per_token"] * r["tokens_per_s"] / (8 * 0.5e12)
        assert math.isclose(r["mfu"], want, rel_tol=1e-9), (name, r)
        assert r["lr"] == (summary["args"]["lr"] if name == "muon" else summary["args"]["adam_lr"])
    adamw = [r for r in recs if r["optimizer"] == "adamw"]
    raw = lm_metrics.time_to_adamw_loss(recs)
    assert raw["adamw_final_val_loss"] == adamw[-1]["val_loss"]
    assert raw["adamw_train_s"] == pytest.approx(lm_metrics.train_seconds(adamw)[-1])
    # The race line and summary.json's record of it appear together, or a note says why not.
    race, note = lm_metrics.adamw_loss_race(recs)
    assert (summary["time_to_adamw_final_loss"], summary["time_to_adamw_final_loss_note"]) == (
        race, note)
    assert ("Muon reached AdamW's final validation loss between" in text) == (race is not None)
    assert (race is None) == (note is not None) and (note is None or note in text)


def test_training_clock_excludes_compilation_and_finds_the_crossing():
    recs = [{"optimizer": "muon", "step": 1, "step_s": 9.0, "compiles": True},
            {"optimizer": "muon", "step": 2, "step_s": 1.0, "val_loss": 3.0},
            {"optimizer": "muon", "step": 3, "step_s": 3.0, "compiles": True},  # a resume
            {"optimizer": "muon", "step": 4, "step_s": 2.0, "val_loss": 1.5},
            {"optimizer": "adamw", "step": 1, "step_s": 5.0, "compiles": True},
            {"optimizer": "adamw", "step": 2, "step_s": 2.0, "val_loss": 2.0}]
    muon = recs[:4]
    np.testing.assert_allclose(lm_metrics.train_seconds(muon), [1.5, 2.5, 4.0, 6.0])
    assert lm_metrics.time_to_loss(muon, 2.0) == 6.0 and lm_metrics.time_to_loss(muon, 1.0) is None
    race = lm_metrics.time_to_adamw_loss(recs)
    assert race["adamw_train_s"] == 4.0 and race["muon_time_to_adamw_final_loss_s"] == 6.0
    assert race["muon_time_to_adamw_final_loss_fraction"] == 1.5
    # the crossing lies after the evaluation at step 2 (2.5 s, still above AdamW's 2.0)
    assert lm_metrics.time_to_loss_bracket(muon, 2.0) == (2.5, 6.0)
    assert race["muon_time_to_adamw_final_loss_after_s"] == 2.5
    assert race["muon_time_to_adamw_final_loss_fraction_after"] == 2.5 / 4.0
    assert lm_metrics.time_to_adamw_loss(muon) is None


def test_the_race_is_reported_only_when_evaluations_bracket_the_crossing():
    def recs(muon_vals, adamw_final=2.0):
        out = [{"optimizer": "adamw", "step": 1, "step_s": 1.0, "val_loss": adamw_final}]
        return out + [{"optimizer": "muon", "step": i + 1, "step_s": 1.0, "val_loss": v}
                      for i, v in enumerate(muon_vals)]

    race, note = lm_metrics.adamw_loss_race(recs([3.0, 2.5, 1.5]))
    assert note is None and race["muon_time_to_adamw_final_loss_s"] == 3.0
    assert race["muon_time_to_adamw_final_loss_after_s"] == 2.0
    # A first evaluation already past AdamW's final loss (e.g. --steps 2 evaluates once) times
    # nothing: the bracket would be "between 0 s and the end".
    race, note = lm_metrics.adamw_loss_race(recs([1.5]))
    assert race is None and note.startswith("Muon's first evaluation (step 1) had already "
                                            "reached AdamW's final validation loss (2.0000)")
    race, note = lm_metrics.adamw_loss_race(recs([3.0, 2.5]))
    assert race is None and "did not reach AdamW's final validation loss (2.0000)" in note
    assert lm_metrics.adamw_loss_race(recs([3.0])[1:]) == (None, None)  # Muon alone


def test_mfu_is_na_on_cpu_without_a_peak():
    args = train_lm.parse_args(TINY)
    assert train_lm.peak_tflops(args) is None
    assert train_lm.peak_tflops(train_lm.parse_args([*TINY, "--peak-tflops", "989"])) == 989.0


@pytest.mark.parametrize("kw", [{}, {"tie_embeddings": True}, {"num_experts": 4, "top_k": 1}])
def test_param_counts_match_the_model(kw):
    cfg = lm_model.LMConfig(d_model=32, num_heads=2, d_ff=16, **kw)
    model = _abstract_model(cfg)
    sizes = {jax.tree_util.keystr(p): int(np.prod(x.shape))
             for p, x in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))}
    counts = lm_model.param_counts(cfg)
    assert counts["total"] == sum(sizes.values())
    # Active: every matrix a token multiplies by, the expert banks at top_k / num_experts.
    active = sum(n * (cfg.top_k / cfg.num_experts if "w_gate_up" in k or "w_down" in k else 1)
                 for k, n in sizes.items()
                 if "norm" not in k and ("embed" not in k or cfg.tie_embeddings))
    assert counts["active"] == active
    assert lm_model.train_flops_per_token(cfg, 64) == 6 * active + 12 * 2 * 32 * 64


def test_presets_and_explicit_flags():
    gpu = train_lm.parse_args(["--preset", "gpu"])
    assert (gpu.d_model, gpu.layers, gpu.experts, gpu.batch, gpu.seq_len, gpu.dtype) == (
        1024, 8, 16, 64, 1024, "bfloat16")
    assert (gpu.lr, gpu.adam_lr) == train_lm.default_lrs(1024)
    # The rule's two anchors: the CPU default and the GPU preset's measured sweep.
    assert train_lm.default_lrs(128) == (0.02, 6e-3)
    assert train_lm.default_lrs(1024) == pytest.approx((2.5e-3, 7.5e-4), rel=1e-12)
    assert train_lm.default_lrs(64) == (0.02, 6e-3)  # never above the small-model values
    cpu = train_lm.parse_args([])
    assert (cpu.d_model, cpu.layers, cpu.batch, cpu.seq_len, cpu.dtype) == (
        128, 2, 32, 128, "float32")
    assert (cpu.lr, cpu.adam_lr) == train_lm.default_lrs(128)
    mixed = train_lm.parse_args(["--preset", "gpu", "--d-model", "256", "--steps", "7",
                                 "--adam-lr", "1e-4"])
    assert (mixed.d_model, mixed.steps, mixed.layers) == (256, 7, 8)
    assert (mixed.lr, mixed.adam_lr) == (train_lm.default_lrs(256)[0], 1e-4)


def test_pgle_choice_and_the_chunks_it_brings():
    assert train_lm.parse_args([]).pgle == "auto"
    auto = dict(backend="gpu", devices=8, processes=1)
    assert train_lm.use_pgle("auto", **auto)
    assert not train_lm.use_pgle("auto", **{**auto, "devices": 1})  # nothing to hide
    assert not train_lm.use_pgle("auto", **{**auto, "processes": 2})  # each would profile alone
    assert not train_lm.use_pgle("auto", **{**auto, "backend": "cpu"})
    assert train_lm.use_pgle("on", backend="cpu", devices=1, processes=1)
    assert not train_lm.use_pgle("off", **auto)

    def mesh(data, expert):
        return types.SimpleNamespace(shape={"data": data, "expert": expert},
                                     devices=np.zeros((data, expert)))

    gpu = train_lm.parse_args(["--preset", "gpu"])  # 64 x 1024 tokens: 8192 per device of 8
    assert train_lm.resolve_overlap_chunks(gpu, mesh(1, 8), pgle=False) == "auto"
    assert train_lm.resolve_overlap_chunks(gpu, mesh(1, 8), pgle=True) == (
        train_lm.PGLE_OVERLAP_CHUNKS)
    assert train_lm.resolve_overlap_chunks(gpu, mesh(8, 1), pgle=True) == "auto"  # no exchange
    small = train_lm.parse_args(["--preset", "gpu", "--batch", "16"])  # 2048 per device
    assert train_lm.resolve_overlap_chunks(small, mesh(1, 8), pgle=True) == "auto"
    given = train_lm.parse_args(["--preset", "gpu", "--overlap-chunks", "2"])
    assert train_lm.resolve_overlap_chunks(given, mesh(1, 8), pgle=True) == 2


@pytest.mark.parametrize("recipe", ["none", "forward", "forward_dgrad", "all"])
def test_fp8_gemms_flag_sets_each_expert_gemm(recipe):
    proj = {"none": "all", "all": "none"}.get(recipe, recipe)
    args = train_lm.parse_args(["--d-model", "32", "--heads", "2", "--fp8-gemms", recipe,
                                "--fp8-projections", proj])
    recipes = {"none": ("bf16",) * 3, "forward": ("fp8", "bf16", "bf16"),
               "forward_dgrad": ("fp8", "fp8", "bf16"), "all": ("fp8",) * 3}
    cfg = train_lm.model_config(args)
    model = _abstract_model(cfg)
    eo = model.blocks[0].moe.options.experts
    assert (eo.gemm_dtype, eo.dgrad_dtype, eo.wgrad_dtype) == recipes[recipe]
    attn = model.blocks[0].attn
    if proj == "none":
        assert attn.fp8 is None
    else:
        assert (attn.fp8["dgrad_dtype"], attn.fp8["wgrad_dtype"]) == recipes[proj][1:]
    text = train_lm.describe(args, train_lm.build_mesh(None), _Corpus)
    assert f"FP8 GEMMs {recipe}, projections {proj}" in text


def test_attention_and_projection_options():
    """'auto' attention is XLA's einsums off NVIDIA GPUs; bad choices name their field."""
    assert lm_model.LMConfig(dtype="bfloat16").attention_impl() == "xla"  # on the CPU
    assert lm_model.LMConfig(attention="cudnn").attention_impl() == "cudnn"
    with pytest.raises(ValueError, match="attention must be"):
        lm_model.LMConfig(attention="flash")
    with pytest.raises(ValueError, match="proj_wgrad_dtype"):
        lm_model.LMConfig(proj_gemm_dtype="fp8", proj_wgrad_dtype="fp16")
    with pytest.raises(ValueError, match="need proj_gemm_dtype='fp8'"):
        lm_model.LMConfig(proj_dgrad_dtype="fp8")


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        train_lm.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 0.01)" in text  # --weight-decay
    assert "(default: cpu)" in text  # --preset
    assert "default from --preset (cpu 128, gpu 1024)" in text  # --d-model


def test_router_on_adamw_mask():
    cfg = lm_model.LMConfig(d_model=32, num_heads=2, d_ff=16, num_experts=4)
    params = nnx.state(_abstract_model(cfg), nnx.Param)
    flags = {jax.tree_util.keystr(p): f for p, f in
             jax.tree_util.tree_leaves_with_path(train_lm.router_on_adamw(params))}
    default = {jax.tree_util.keystr(p): f for p, f in
               jax.tree_util.tree_leaves_with_path(train_lm.muon_jax.default_muon_mask(params))}
    routers = [k for k in flags if "router_kernel" in k]
    assert routers and all(default[k] and not flags[k] for k in routers)
    assert {k: f for k, f in flags.items() if k not in routers} == {
        k: f for k, f in default.items() if k not in routers}


def test_resume_message_names_step_path_and_mesh(tmp_path):
    class Manager:
        directory = tmp_path

    mesh = train_lm.build_mesh("2,4")
    (tmp_path / "meshes.json").write_text(json.dumps({"3": {"data": 4, "expert": 2},
                                                      "6": {"data": 2, "expert": 4}}))
    msg = lm_checkpoint.resume_message("muon", Manager, 3, mesh)
    assert f"resumed at step 3 from {tmp_path / '3'}" in msg
    assert "saved on mesh {'data': 4, 'expert': 2}, now {'data': 2, 'expert': 4}" in msg
    assert "same mesh" in lm_checkpoint.resume_message("muon", Manager, 6, mesh)
    assert "no checkpoint" in lm_checkpoint.resume_message("muon", Manager, 0, mesh)


def test_resume_continues_exactly(tmp_path, capsys, cli):
    """2 x N steps with a restart in between equal N + N uninterrupted (same losses)."""
    common = [*TINY, "--optimizer", "muon", "--fp8-dispatch", "--fp8-gemms", "forward_dgrad",
              "--fp8-projections", "all", "--eval-every", "100",
              "--ckpt-every", "3"]
    full, split = tmp_path / "full", tmp_path / "split"
    # The uninterrupted run also shows --keep-checkpoints 0 keeping every checkpoint (here
    # every 2 steps; the default would keep the newest 2).
    assert train_lm.main([*common, "--steps", "6", "--ckpt-every", "2", "--keep-checkpoints",
                          "0", "--out", str(full)]) == 0
    assert _checkpoints(full, "muon") == [2, 4, 6]
    # First half: a run whose schedule is the 6-step one, stopped at its step-3 checkpoint.
    capsys.readouterr()
    assert train_lm.main([*common, "--steps", "6", "--stop-after", "3", "--out", str(split)]) == 0
    assert [s for s, _ in _losses(split, "muon")] == [1, 2, 3]
    text = capsys.readouterr().out
    assert "muon: stopped at step 3 of 6; continue with --resume; validation loss" in text
    assert "final validation" not in text and "AdamW run" not in text  # only Muon runs
    summary = json.loads((split / "summary.json").read_text())["results"]["muon"]
    assert summary["stopped_early"] and summary["last_step"] == 3
    _checkpoint_mismatches_are_refused(common, split, cli)
    assert train_lm.main([*common, "--steps", "6", "--resume", "--out", str(split)]) == 0
    assert _losses(split, "muon") == _losses(full, "muon")
    text = capsys.readouterr().out
    assert f"[muon] resumed at step 3 from {(split / 'ckpt' / 'muon' / '3').resolve()}" in text
    assert "same mesh {'data': 2, 'expert': 4}" in text


def _checkpoint_mismatches_are_refused(common, out, cli):
    """A --resume of ``out``'s step-3 Muon checkpoint (d_model 64) that cannot fit is refused
    in one line, before JAX starts (``cli``); a new mesh, top-k or dtype is not."""
    ckpt = out / "ckpt" / "muon"
    assert json.loads((ckpt / "settings.json").read_text())["3"] == {
        "d_model": 64, "layers": 1, "heads": 2, "d_ff": 32, "experts": 4,
        "tie_embeddings": False, "router_optimizer": "muon"}
    resume = [*common, "--steps", "6", "--resume", "--out", str(out)]
    assert _one_line_error(cli(*resume, "--d-model", "32", "--tie-embeddings")) == (
        f"--resume: the checkpoint {ckpt / '3'} does not fit the run asked for: it was trained "
        "with --d-model 64 (asked: 32), --tie-embeddings off (asked: on). To resume it, pass "
        "--d-model 64 and leave out --tie-embeddings; or start fresh with another --out.")
    assert "--router-optimizer muon (asked: adamw)" in _one_line_error(
        cli(*resume, "--router-optimizer", "adamw"))
    assert _one_line_error(cli(*resume, "--optimizer", "adamw")) == (
        f"--resume: --out {out} holds checkpoints of muon, not of --optimizer adamw: pass "
        "--optimizer muon to resume them, or another --out to start fresh.")
    # A fresh run would save among them (orbax skips steps up to its latest): refused too.
    assert _one_line_error(cli(*common, "--steps", "6", "--out", str(out))) == (
        f"--out {out} already holds an earlier run's checkpoints (muon at step 3): pass "
        f"--resume to continue it, or another --out (or delete {out / 'ckpt'}) to start fresh.")
    for fits in (["--mesh", "4,2"], ["--top-k", "1"], ["--dtype", "bfloat16"]):
        train_lm.checked_args([*resume, *fits])  # the Muon state is stored mesh-independently
    # A checkpoint saved before settings.json existed is compared array by array instead.
    legacy = out.parent / "legacy"
    shutil.copytree(out / "ckpt", legacy / "ckpt")
    (legacy / "ckpt" / "muon" / "settings.json").unlink()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert train_lm.main([*common, "--steps", "6", "--resume", "--d-model", "32",
                              "--out", str(legacy)]) == 2
    lines = err.getvalue().strip().splitlines()
    where = (legacy / "ckpt" / "muon").resolve() / "3"
    assert len(lines) == 1 and lines[0].startswith(
        f"train_lm.py: error: --resume: the checkpoint {where} does not fit the run asked for "
        "(model/"), lines
    assert "is (64, 64) there, (32, 32) here); it was saved before checkpoints recorded" in (
        lines[0])


def test_setup_line_names_only_the_runs_it_trains():
    def line(opt):
        return train_lm.describe(train_lm.parse_args([*TINY, "--optimizer", opt]),
                                 train_lm.build_mesh("2,4"), _Corpus)

    assert "Muon run" in line("muon") and "AdamW run" not in line("muon")
    assert "AdamW run" in line("adamw") and "Muon run" not in line("adamw")
    assert "Muon run" in line("both") and "AdamW run" in line("both")


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--keep-checkpoints", "-1"], "--keep-checkpoints must be >= 0"),
        (["--optimizer", "sgd"], "--optimizer must be one of"),
        (["--mesh", "1,4"], "--mesh 1,4 needs 4 devices but 8 are available"),
        (["--batch", "12"], "--batch 12 must be divisible by the 8 devices"),
        (["--experts", "6"], "--experts 6 must be divisible by the expert axis size 4"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--micro-batches", "3"], "--batch (8) must be a multiple of --micro-batches (3)"),
        (["--overlap-chunks", "two"], "--overlap-chunks must be an int >= 1 or 'auto'"),
    ],
)
def test_bad_flags_one_line(flags, needle, capsys):
    assert train_lm.main([*TINY, *flags, "--out", "/nonexistent/never-written"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert needle in err and "Traceback" not in err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--d_model", "64"], "unknown flag --d_model (did you mean --d-model? train_lm.py "
                              "--help lists the flags)."),
        (["--frobnicate"], "unknown flag --frobnicate (train_lm.py --help lists the flags)."),
        (["runs/x"], "unexpected argument 'runs/x' (the trainer takes flags only; train_lm.py "
                     "--help lists them)."),
        (["--optimizer", "lion"], "--optimizer must be one of muon, adamw, both, got 'lion'."),
        (["--steps", "x"], "argument --steps: invalid int value: 'x'"),
        (["--eval-every", "0"], "--eval-every must be >= 1, got 0."),
        (["--heads", "3"], "--d-model 128 must split into --heads 3 heads of an even width "
                           "(rotary embeddings); choose --heads dividing 128 with an even "
                           "quotient."),
        (["--mesh", "2x4"], "--mesh must look like 'data,expert' (e.g. 2,4), got '2x4'."),
        (["--mesh", "2,4", "--experts", "6"], "--experts 6 must be divisible by the expert axis "
                                              "size 4 of --mesh 2,4 (set --mesh or --experts)."),
    ],
)
def test_bad_command_line_is_one_line_before_jax_loads(flags, message, cli):
    assert _one_line_error(cli(*flags)) == message


def test_help_before_jax_loads(cli):
    proc = cli("--help")
    assert proc.returncode == 0 and "--d-model" in proc.stdout, proc.stderr


def test_ns_method_choices_are_muon_jax_ones():
    assert lm_flags.NS_METHODS == train_lm.muon_jax.newton_schulz.NS_METHODS
