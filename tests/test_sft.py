"""The supervised warm start (`espo.sft`): padded and packed demonstration batches.

A packed batch must train exactly like the padded one: the same NLL and the same gradient
(each token sees only its own demonstration, RoPE restarts per demonstration, the router's
auxiliary loss averages the same real tokens). What would be wrong (each fails a test here):
a packed token attending to its row neighbour's demonstration (segment ids dropped), positions
counted along the row, the prompt scored as a target, a demonstration lost by the packing.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from espo import model as model_lib
from espo import sft

CFG = model_lib.ModelConfig(
    vocab_size=32, d_model=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8,
    num_experts=4, top_k=2, moe_ffn_dim=16, aux_loss_coef=0.01, z_loss_coef=0.001,
)  # fmt: skip
TP, TC = 4, 6


def _demonstrations(seed: int = 0, n: int = 10):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 32, rng.integers(1, TP + 1)).tolist() for _ in range(n)]
    completions = [rng.integers(3, 32, rng.integers(1, TC + 1)).tolist() for _ in range(n)]
    return sft.demonstration_batch(
        prompts, completions, prompt_length=TP, completion_length=TC, pad_id=0
    )


def test_packed_batch_holds_every_demonstration_once_in_multiples_of_eight_rows():
    padded = sft.demonstration_batch(
        [[5, 6], [7], [8, 9, 10]], [[11], [12, 13, 14], [15, 16]],
        prompt_length=3, completion_length=3, pad_id=0,
    )  # fmt: skip
    # Lengths 3, 4, 5 in rows of 6: first-fit decreasing puts 5 alone, then 4, then 3 with
    # nothing (4 + 3 > 6, 5 + 3 > 6): 3 rows, rounded up to 8.
    packed = sft.packed_batch(padded)
    assert packed["tokens"].shape == (sft.ROW_MULTIPLE, 6)
    np.testing.assert_array_equal(packed["tokens"][0, :5], [8, 9, 10, 15, 16])
    np.testing.assert_array_equal(packed["segment_ids"][0], [1, 1, 1, 1, 1, 0])
    np.testing.assert_array_equal(packed["loss_mask"][0], [0, 0, 0, 1, 1, 0])
    assert packed["attention_mask"][3:].sum() == 0  # rows 3..7 are padding
    # Every real token and every target once, as in the padded batch.
    for key in ("attention_mask", "loss_mask"):
        assert packed[key].sum() == padded[key].sum()
    assert sorted(packed["tokens"][packed["attention_mask"]]) == sorted(
        padded["tokens"][padded["attention_mask"]]
    )

    # Short demonstrations share rows: 10 of lengths 2..10 in rows of 10.
    many = _demonstrations()
    packed = sft.packed_batch(many)
    assert packed["segment_ids"].max() >= 2
    assert packed["tokens"].shape[0] % sft.ROW_MULTIPLE == 0
    assert packed["loss_mask"].sum() == many["loss_mask"].sum()


@pytest.mark.slow
def test_packed_nll_and_gradient_equal_the_padded_batch():
    params = jax.jit(model_lib.init, static_argnums=0)(CFG, jax.random.key(0))
    padded = _demonstrations(seed=1)
    packed = sft.packed_batch(padded)
    assert packed["segment_ids"].max() >= 2  # rows really hold several demonstrations
    # Jitted (one compile per batch shape): op by op, the MoE's forward and backward dispatched
    # thousands of tiny programs.
    loss = jax.jit(jax.value_and_grad(lambda p, b: sft.nll(CFG, p, b)))
    (l_pad, g_pad), (l_pack, g_pack) = loss(params, padded), loss(params, packed)
    np.testing.assert_allclose(l_pack, l_pad, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), g_pack, g_pad)
