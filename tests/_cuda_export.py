"""Lower a jitted function for CUDA on a CPU-only machine (Pallas -> Triton), for tests."""

from __future__ import annotations

import jax
import pytest
from jax import export


def cuda_module(fn, *args) -> str:
    """The StableHLO text of ``jax.jit(fn)`` exported for 'cuda' (Triton calls allowed);
    skips the test when this jaxlib cannot lower Pallas to Triton."""
    chk = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    try:
        exp = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=chk)(*args)
    except Exception as e:  # pragma: no cover - depends on the jaxlib build
        if "triton" in str(e).lower() and "lower" not in str(e).lower():
            pytest.skip(f"this jaxlib cannot lower Pallas to Triton: {e}")
        raise
    return exp.mlir_module()
