"""The update's layouts and diagnostics: train.scan_layers=False (an unrolled loop over
per-layer params) against the scan, and train.replay_counterfactual's paired mismatch metrics.
(Apart from tests/test_update.py so that the two files run on different test workers.)"""

from __future__ import annotations

import dataclasses
import functools
import pathlib

import chex
import jax
import numpy as np
import pytest

from espo import batching, testing, train_step
from espo import model as model_lib

# tests/ is not a package (pytest runs with --import-mode=importlib): the module loads by path.
_update = testing.load_script(
    pathlib.Path(__file__).with_name("test_update.py"), name="espo_tests_update"
)
CFG, N, TG, TP, _sc = _update.CFG, _update.N, _update.TG, _update.TP, _update._sc
# A leading dense layer, then a run of two MoE layers.
LAYERED = CFG.replace(num_layers=3, dense_layers=(0,), dense_ffn_dim=12)


@functools.cache
def _layered_batch():
    """(batch, params, a reference policy unlike the policy) of the LAYERED model."""
    batch, params = testing.random_train_batch(
        LAYERED, num_rows=N, prompt_length=TP, generation_length=TG, seed=5
    )
    return batch, params, jax.tree.map(lambda a: a * 0.9, params)


def _layered_sc(*, unroll: bool, budget: int | None):
    sc = _sc(N, model=LAYERED, kl_coef=0.1)
    return dataclasses.replace(sc, scan_layers=not unroll, packing_budget=budget)


@functools.cache
def _prepared(unroll: bool):
    """`prepare` of the layered batch: on padded rows (no layout) in both cases of the test
    below, so computed once for both."""
    batch, params, ref = _layered_batch()
    sc = _layered_sc(unroll=unroll, budget=None)
    return jax.jit(functools.partial(train_step.prepare, sc))(params, ref, batch)[0]


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_unrolled_layers_make_the_same_update(packed):
    """train.scan_layers=False: prepare (pi_old and the reference under
    replay) and the update run an unrolled loop over per-layer params, and the gradient is
    stacked back: the same prepared batch and new params as the scan, on a model with a leading
    dense layer (two layer runs). A gradient stacked in the wrong layer order, or a run
    dropped, fails it."""
    _, params, _ = _layered_batch()
    budget = TP + TG if packed else None
    out = {}
    for unroll in (False, True):
        sc = _layered_sc(unroll=unroll, budget=budget)
        prepared = _prepared(unroll)
        (mini,) = batching.minibatches(
            prepared, mini_batch_size=N, micro_batch_size=N, epochs=1, key=jax.random.key(0),
            packing_budget=budget,
        )  # fmt: skip
        out[unroll] = prepared, *testing.sgd_update(sc, params, mini)
    (p_scan, s_scan, m_scan), (p_unroll, s_unroll, m_unroll) = out[False], out[True]
    for field in ("old_logps", "old_entropies", "ref_logps"):
        np.testing.assert_allclose(
            getattr(p_scan, field), getattr(p_unroll, field), atol=1e-5, err_msg=field
        )
    assert jax.tree.structure(s_scan.params) == jax.tree.structure(s_unroll.params)
    chex.assert_trees_all_close(s_scan.params, s_unroll.params, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(m_scan["loss/loss"], m_unroll["loss/loss"], rtol=1e-5)
    assert float(m_scan["optim/grad_norm"]) > 1e-3


@pytest.mark.slow
def test_replay_counterfactual_measures_the_other_routing_on_the_same_batch():
    """train.replay_counterfactual: prepare's mismatch/counterfactual/* are the mismatch of
    pi_old under the other routing (free when replaying, replayed when not) on the same batch,
    computed here from `token_logps`, and mismatch/free_agreement/layer_<l> is a free forward's
    expert agreement with the trace at each MoE layer (a dense layer 1 has none). The routes
    of another model make the two routings differ. A swapped routing, or the agreement of the
    replayed forward's own top-k, fails it."""
    cfg = CFG.replace(num_layers=3, dense_layers=(1,), dense_ffn_dim=12)
    batch, params = testing.random_train_batch(
        cfg, num_rows=N, prompt_length=TP, generation_length=TG, seed=5
    )
    # Jitted: op by op, each of these forwards took seconds.
    other = jax.jit(model_lib.init, static_argnums=0)(cfg, jax.random.key(99))
    mask, logps = batch.loss_mask, {}
    modes = {"free": train_step.RoutingMode.FREE, "replay": train_step.RoutingMode.REPLAY_IDS}
    token_logps = jax.jit(
        train_step.token_logps, static_argnums=0, static_argnames=("routing_mode", "replay_missing")
    )
    for mode, routing_mode in modes.items():
        logps[mode] = token_logps(
            cfg, other, batch.tokens, batch.attention_mask, routing=batch.router,
            routing_mode=routing_mode, replay_missing="free",
        ).logps  # fmt: skip
    forward = jax.jit(model_lib.forward, static_argnums=0)
    free = forward(cfg, other, batch.tokens, attention_mask=batch.attention_mask)
    ids, want = np.asarray(free.router.expert_ids), np.asarray(batch.router.expert_ids)
    same = (ids[..., :, None] == want[..., None, :]).any(-1).mean(-1)  # [B, L, T]
    for replay, fused, cf_mode in (
        (True, False, "free"),
        (False, False, "replay"),
        (False, True, "replay"),
    ):
        sc = dataclasses.replace(
            _sc(4, replay=replay, model=cfg), replay_counterfactual=True, fused_old_logps=fused
        )
        _, m = jax.jit(lambda p, b, sc=sc: train_step.prepare(sc, p, None, b))(other, batch)
        want_m = train_step.mismatch_metrics(sc, logps[cf_mode], batch.sampler_logps, mask)
        for key in ("k3_kl", "extreme_token_frac", "abs_dlogp_mean"):
            np.testing.assert_allclose(
                m[f"mismatch/counterfactual/{key}"], want_m[f"mismatch/{key}"], rtol=1e-4,
                atol=1e-7, err_msg=key,
            )  # fmt: skip
        assert "mismatch/free_agreement/layer_1" not in m
        for layer in (0, 2):
            expect = same[:, layer][mask & (want[:, layer, :, 0] >= 0)].mean()  # recorded
            got = float(m[f"mismatch/free_agreement/layer_{layer}"])
            np.testing.assert_allclose(got, expect, atol=1e-6, err_msg=f"layer {layer}")
        assert float(m["mismatch/free_agreement/layer_2"]) < 0.95
    k3 = {
        mode: train_step.mismatch_metrics(sc, x, batch.sampler_logps, mask)
        for mode, x in logps.items()
    }
    assert abs(float(k3["free"]["mismatch/k3_kl"]) - float(k3["replay"]["mismatch/k3_kl"])) > 1e-4
