"""report.py --ab-pairs (benchmarks/_lib/ab.py) against the real tree before the refactor,
8b11414: the base packages load under other names and run their own code, and one pair runs
end to end at --small sizes on CPU; the muon_step pair against 54b8671 (issue 63's base, from
before accel_kernels), with its keys."""

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from _paths import ROOT, compile_flags

sys.path.insert(0, str(ROOT / "benchmarks"))

from _lib import ab  # noqa: E402  (benchmarks/_lib/ab.py)

BASE = "8b11414"
# The scripts set their own device count; they keep the session's compile settings.
ENV = os.environ | {"XLA_FLAGS": compile_flags(), "JAX_PLATFORMS": "cpu"}


def _export(commit, tmp_path_factory):
    """The library and examples of ``commit``, exported with a COMMIT file."""
    if shutil.which("git") is None:
        pytest.skip("no git: the base tree comes from git archive")
    if subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"],
                      capture_output=True).returncode:
        pytest.skip(f"commit {commit} is not in this clone (shallow?)")
    tree = tmp_path_factory.mktemp("base")
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "moe", "muon_jax",
                          "xla_comm", "examples"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=tar, check=True)
    (tree / "COMMIT").write_text(commit + "\n")
    return tree


@pytest.fixture(scope="module")
def base_tree(tmp_path_factory):
    return _export(BASE, tmp_path_factory)


def test_rename_source_renames_code_and_module_paths_only():
    src = textwrap.dedent('''\
        import moe.kernels as k  # moe stays in comments
        from muon_jax import x
        def f(moe=None):
            """moe.kernels in a docstring"""
            self.moe = moe.MoE(); y = "moe"; z = "moe.kernels"; w = "moe.kernels."
            return importlib.import_module("moe.kernels.gmm"), f"{1}moe", k.moe
        ''')
    out, n = ab.rename_source(src, {"moe": "moe_base", "muon_jax": "muon_jax_base"},
                              {"moe", "moe.kernels", "moe.kernels.gmm"})
    assert n == 2 and out == src.replace("import moe.kernels", "import moe_base.kernels").replace(
        "from muon_jax", "from muon_jax_base").replace("f(moe=", "f(moe_base=").replace(
        "= moe.MoE", "= moe_base.MoE").replace('"moe.kernels"', '"moe_base.kernels"').replace(
        '"moe.kernels.gmm"', '"moe_base.kernels.gmm"')
    if sys.version_info >= (3, 12):  # f-strings' code is tokenized as code
        assert ab.rename_source('f"{moe.x}"\n', {"moe": "moe_base"}, set())[0] == (
            'f"{moe_base.x}"\n')
    else:  # one STRING token: refused rather than left to the other tree
        with pytest.raises(ValueError, match="f-string"):
            ab.rename_source('f"{moe.x}"\n', {"moe": "moe_base"}, set())


def test_the_base_copy_runs_its_own_code(base_tree):
    """Both trees in one process: each module from its own tree, and a behaviour that differs
    between them (8b11414 keeps the grouped-GEMM name 'einsum'; this tree spells it 'xla' and
    warns for the old name; it alone has accel_kernels)."""
    script = textwrap.dedent(f"""
        import json, sys, warnings
        sys.path.insert(0, {str(ROOT / 'benchmarks')!r})
        from _lib import ab
        new, base = ab.new_tree(False), ab.load_base({str(base_tree)!r}, False)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            ex = {{s: t.moe.MoEOptions.create(4, 2, backend="einsum").experts
                   for s, t in (("new", new), ("base", base))}}
        got = {{s: getattr(e, "gemm_implementation", None) or e.backend for s, e in ex.items()}}
        print(json.dumps(dict(got=got, warned=[str(x.message) for x in w],
                              base_file=base.moe.__file__, dir=str(base.dir),
                              names=base.names, restored=base.restored,
                              foreign=ab.check_own_code(base),
                              accel=sys.modules["accel_kernels"].__file__)))
        """)
    res = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=ENV, timeout=300,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    shutil.rmtree(r["dir"])
    assert r["got"] == {"new": "xla", "base": "einsum"}
    assert any("'einsum' is deprecated" in m for m in r["warned"])
    assert r["base_file"].startswith(r["dir"]) and r["foreign"] == []
    assert "accel_kernels" not in r["names"] and r["accel"].startswith(str(ROOT))
    assert r["restored"] == ["flax variable name 'balancing_bias'"]


@pytest.mark.slow
def test_one_pair_end_to_end(base_tree, tmp_path):
    out = tmp_path / "ab.json"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "report.py"), "--ab-pairs",
                          str(base_tree), "--pairs", "layer", "--small", "--rounds", "2",
                          "--out", str(out)], cwd=ROOT, env=ENV, timeout=600,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["base_commit"] == BASE and r["commit"] and r["device"] == "cpu"
    assert r["complete"] and r["all_agree"] and not r["errors"]
    assert isinstance(r["all_within_3pct"], bool) and r["max_abs_log_ratio"] >= 0
    layer = r["pairs"]["layer"]
    assert set(layer["cases"]) == {"dropless", "dense"} and layer["loader"]["foreign_modules"] == []
    for case in layer["cases"].values():
        assert case["agreement"]["ok"] and case["base_ms"] > 0 and case["new_ms"] > 0
        assert case["new_over_base"] == pytest.approx(case["new_ms"] / case["base_ms"])
        assert len(case["samples_ms"]["new"]) == 2
    assert "new/base" in res.stdout and "layer" in res.stdout


def test_ns_rules_count_the_symmetric_kernel_and_cublas_as_gemms():
    """ns_passes's classification: the Mosaic symmetric-tile kernel by its tiles_W_of_T scope,
    cuBLAS by its target, fusions by their ops; another Mosaic call is not a GEMM."""
    from xla_comm.breakdown import categorize_hlo

    text = """HloModule m
%fused (p: f32[2,8,8]) -> bf16[2,8,8] {
  %p = f32[2,8,8]{2,1,0} parameter(0)
  ROOT %c = bf16[2,8,8]{2,1,0} convert(%p)
}
ENTRY %main (u: f16[2,8,4], t: s32[3]) -> bf16[2,8,8] {
  %u = f16[2,8,4]{2,1,0} parameter(0)
  %t = s32[3]{0} parameter(1)
  %other = f32[2,8,8]{2,1,0} custom-call(%t, %t, %u, %u), custom_call_target="mosaic_gpu_v2"
  %blas = f32[2,8,8]{2,1,0} custom-call(%u, %u), custom_call_target="__cublas$gemm"
  %upper = f32[2,8,8]{2,1,0} custom-call(%t, %t, %u, %u), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(f)/tiles_3_of_4/symmetric_upper_f16/mpmd_map"}
  ROOT %cast = bf16[2,8,8]{2,1,0} fusion(%upper), kind=kLoop, calls=%fused
}"""  # noqa: E501  (one HLO instruction per line)
    got = categorize_hlo(text, ab.NS_RULES)
    assert [got[k] for k in ("other", "blas", "upper", "cast")] == [
        "other", "gemm", "gemm", "other"]


@pytest.mark.slow
def test_muon_step_pair_against_54b8671_gives_issue_63s_keys(tmp_path_factory, tmp_path,
                                                             monkeypatch):
    """54b8671 (no accel_kernels; muon(..., mesh=)) loads beside this tree; the pair writes
    update_over_54b8671, orthogonality_error_ratio and ns_passes_over_gemm_time, which
    ``report.py --adopt NAME RUN --keys-from AB`` puts in a record of the same commit and
    device, and refuses for another."""
    out = tmp_path / "ab.json"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "report.py"), "--ab-pairs",
                          str(_export("54b8671", tmp_path_factory)), "--pairs", "muon_step",
                          "--small", "--rounds", "1", "--out", str(out)], cwd=ROOT, env=ENV,
                         timeout=600, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r = json.loads(out.read_text())
    ms = r["pairs"]["muon_step"]
    assert r["base_commit"] == "54b8671" and r["complete"] and ms["loader"]["foreign_modules"] == []
    for k in ("update_over_54b8671", "orthogonality_error_ratio", "ns_passes_over_gemm_time"):
        assert math.isfinite(r[k]) and r[k] > 0, k
    assert r["update_over_54b8671"] == ms["cases"]["update"]["new_over_base"]
    assert set(ms["orthogonality"]["error"]["base"]) == {"wq", "w_gate", "w_down"}
    assert 0 < ms["orthogonality"]["error"]["new"]["wq"] < 1 and ms["ns_profile"]["us_per_step"]
    import report  # benchmarks/report.py

    monkeypatch.setattr(report.records, "CURRENT", tmp_path)
    run = tmp_path / "run.json"
    env = {"python": "3", "jax": "0", "commit": r["commit"], "device_kind": "cpu", "n_devices": 1,
           "dirty": False, "argv": ["python3", "benchmarks/muon_step.py"]}
    run.write_text(json.dumps({"env": env, "ceilings": [{"name": "dense_bf16", "tflops": 1.0}]}))
    got = json.loads(report.adopt("muon_step_1gpu", run, keys_from=out).read_text())["results"]
    assert got["update_over_54b8671"] == r["update_over_54b8671"] and got["device"] == "cpu"
    assert got["muon_ab"]["base_commit"] == "54b8671" and got["ns_passes_over_gemm_time"] > 0
    run.write_text(json.dumps({"env": env | {"device_kind": "NVIDIA H100"}}))
    with pytest.raises(ValueError, match="not the commit and device"):
        report.adopt("muon_step_1gpu", run, keys_from=out)
