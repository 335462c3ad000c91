"""The packing benchmark's arms run on a tiny config and compute the same update (numbers are
reported by the script, not asserted here)."""

import pathlib

import numpy as np
import pytest

from espo import testing

PATH = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "bench_train.py"


def test_skewed_lengths_fit_the_prompt_and_generation_budgets():
    bench = testing.load_script(PATH)
    plen, clen = bench.skewed_lengths(np.random.default_rng(0), 500, prompt=32, generation=16)
    assert (plen >= 1).all() and (plen <= 32).all() and (clen >= 1).all() and (clen <= 16).all()
    assert (plen + clen).min() <= 20 < 40 <= (plen + clen).max()  # skewed: short and long rows


@pytest.mark.slow
def test_packing_arms_compute_the_padded_update_with_less_padding():
    bench = testing.load_script(PATH)
    # tiny: T = 32 + 16 = 48; budget 96 is two rows per micro-batch.
    padded, *packed = bench.bench_packing("default:tiny", budgets=[96], repeats=1)
    assert [r["arm"] for r in packed] == ["packed 96"]
    for r in packed:
        np.testing.assert_allclose(r["loss"], padded["loss"], rtol=1e-5, err_msg=r["arm"])
        assert 0 <= r["padding"] < padded["padding"]
        assert r["update_s"] > 0 and r["temp_mb"] > 0
