"""benchmarks/ns4_search.py's pieces (the search itself takes minutes): the stability checks,
the grid estimate of the error ratio, and the recorded best 4-step schedule's worst case."""

import sys

import numpy as np
from _paths import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

import ns4_search as s  # noqa: E402

# the full run's best schedule under the strict constraints (docs/benchmark_log.md)
BEST_BROAD = [(3.915158446105125, -10.50134392937625, 7.055610445884325),
              (4.946906860972035, -15.19650357460802, 11.767824941784347),
              (3.8134525551126996, -8.03909116224938, 4.404240787274983),
              (4.1212272311386915, -7.585085292838752, 4.341458136436558)]


def test_constraints_accept_jordan_and_reject_a_diverging_schedule():
    jordan = np.array([s.JORDAN] * 4).ravel()
    peaks, mins = s.partial_ranges(jordan, x_max=1.0, safety=1.0)
    assert 1.1 < peaks.max() < 1.25 and mins.min() > 0
    assert s.violation(jordan, **s.STRICT) == 0.0
    assert s.hole_depth(jordan) > 0.5
    loud = np.array([(8.0, -20.0, 15.0)] * 4).ravel()  # overshoots: peak > B
    assert s.violation(loud, **s.STRICT) > 0
    assert s.violation(np.array(BEST_BROAD).ravel(), **s.STRICT) < 1e-6


def test_grid_ratios_track_the_exact_ones_and_the_best_schedule_misses_the_bound():
    fam = s.Family(s.spectrum_family(sizes=(512,)))
    np.testing.assert_allclose(fam.exact_ratios([s.JORDAN] * 5), 1.0, rtol=1e-12)
    np.testing.assert_allclose(fam.ratios([s.JORDAN] * 5), 1.0, rtol=2e-2)
    exact = fam.exact_ratios(BEST_BROAD)
    np.testing.assert_allclose(fam.ratios(BEST_BROAD), exact, rtol=2e-2)
    worst = fam.names[int(np.argmax(exact))]
    assert exact.max() > 1.7 and worst == "power1+floor0.001 p512", (worst, exact.max())
