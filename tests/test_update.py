"""The trainer's jitted steps: exact micro-batch accumulation, router replay, prepare's metrics."""

from __future__ import annotations

import dataclasses
import functools
import operator

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from espo import advantages, batching, losses, testing, train_step
from espo import model as model_lib

CFG = model_lib.ModelConfig(
    vocab_size=32, d_model=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8,
    num_experts=4, top_k=2, moe_ffn_dim=16, aux_loss_coef=0.01,
)  # fmt: skip
TP, TG, N = 4, 6, 8


def _batch(seed: int = 0) -> tuple[batching.TrainBatch, dict]:
    """A non-degenerate batch: ragged prompts and completions, a router trace from a forward."""
    return testing.random_train_batch(
        CFG, num_rows=N, prompt_length=TP, generation_length=TG, seed=seed
    )


# Sampler correction with both options on and a band tight enough to reject tokens of the batch
# (old - sampler = -2 noise, noise ~ N(0, 0.1)).
CORRECTION = dict(
    rollout_is="sequence", rollout_rs="token", rollout_rs_low=0.9, rollout_rs_high=1.1
)


def _sc(
    micro: int, *, name: str = "espo", replay: bool = True, model=CFG, **loss
) -> train_step.StepConfig:
    return train_step.StepConfig(
        model=model,
        loss=losses.LossConfig(name=name, vocab_size=CFG.vocab_size, **loss),
        advantage=advantages.AdvantageConfig(rl_zvp=True),
        entropy=train_step.EntropyConfig(),
        num_groups=N // 4,
        micro_batch_size=micro,
        router_replay=replay,
    )


def _update(sc, params, batch):
    return testing.sgd_update(sc, params, batching.split(batch, N // sc.micro_batch_size))


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, loss", [("espo", {}), ("grpo", {}), ("gspo", CORRECTION)], ids=["espo", "grpo", "tis"]
)
def test_micro_batches_accumulate_exactly(name, loss):
    """One update over 8 rows equals 4 micro-batches of 2 (sum num / sum den, not a mean), also
    with sampler correction rejecting tokens (rejected tokens leave every micro-batch's den).

    The router's load-balancing loss is a product of batch means, not a sum over rows, so it is
    off here (with it on, micro-batches weight it per micro-batch: a 6e-5 difference)."""
    batch, params = _batch()
    cfg = dataclasses.replace(CFG, aux_loss_coef=0.0)
    whole, m1 = _update(_sc(N, name=name, model=cfg, **loss), params, batch)
    parts, m4 = _update(_sc(2, name=name, model=cfg, **loss), params, batch)
    chex.assert_trees_all_close(whole.params, parts.params, atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(m1["loss/loss"], m4["loss/loss"], rtol=1e-5, atol=1e-7)
    assert float(m1["optim/grad_norm"]) > 0
    # A mean of per-micro-batch losses (the classic accumulation bug) differs here.
    micro_loss = jax.jit(
        functools.partial(train_step._micro_loss, _sc(2, name=name, model=cfg, **loss))
    )
    micro = batching.split(batch, 4)
    outs = [micro_loss(params, jax.tree.map(operator.itemgetter(i), micro))[1][0]
            for i in range(4)]  # fmt: skip
    assert abs(np.mean([o.loss for o in outs]) - float(m1["loss/loss"])) > 1e-4


@pytest.mark.slow
def test_update_gradient_matches_loss_by_hand():
    """The SGD step is -grad of (sum num + sum den * aux) / sum den computed directly."""
    batch, params = _batch(1)
    sc = _sc(N)
    new, _ = _update(sc, params, batch)

    def objective(p):
        value, (out, _) = train_step._micro_loss(sc, p, batch)
        return value / out.denominator

    step = lambda p: jax.tree.map(operator.sub, p, jax.grad(objective)(p))
    chex.assert_trees_all_close(new.params, jax.jit(step)(params), atol=2e-6, rtol=1e-5)


@pytest.mark.slow
def test_router_replay_changes_the_update():
    """With replay the update forward routes by the trace; a different trace changes it."""
    batch, params = _batch(2)
    a, _ = _update(_sc(N), params, batch)
    ids = batch.router.expert_ids
    moved = np.where(ids >= 0, (ids + 1) % CFG.num_experts, -1)
    shifted = batch.replace(router=batch.router.replace(expert_ids=moved))
    b, _ = _update(_sc(N), params, shifted)
    free_a, _ = _update(_sc(N, replay=False), params, batch)
    free_b, _ = _update(_sc(N, replay=False), params, shifted)
    leaves = lambda x: jax.tree.leaves(x.params)
    diff = jax.jit(  # the largest |difference| of any parameter
        lambda x, y: jnp.stack(
            [jnp.abs(u - v).max() for u, v in zip(leaves(x), leaves(y), strict=True)]
        ).max()
    )
    assert float(diff(a, b)) > 1e-6
    assert float(diff(free_a, free_b)) == 0.0  # free routing ignores the trace


@pytest.mark.slow
def test_prepare_mismatch_and_advantages():
    """pi_old under replay of the model's own routes = its free forward; mismatch by hand."""
    batch, params = _batch(3)
    sc = _sc(4)
    out, m = jax.jit(lambda p, b: train_step.prepare(sc, p, None, b))(params, batch)
    # Jitted: op by op, ~160 small programs each compiled on its own.
    ref = jax.jit(train_step.token_logps, static_argnums=0)(
        CFG, params, batch.tokens, batch.attention_mask
    )
    np.testing.assert_allclose(out.old_logps, ref.logps, atol=1e-5)
    d = np.where(batch.loss_mask, np.asarray(ref.logps) - batch.sampler_logps, 0.0)
    k3 = (np.expm1(d) - d)[batch.loss_mask].mean()
    np.testing.assert_allclose(float(m["mismatch/k3_kl"]), k3, rtol=1e-4)
    frac = (np.abs(d) > np.log(2))[batch.loss_mask].mean()
    np.testing.assert_allclose(float(m["mismatch/extreme_token_frac"]), frac, atol=1e-6)
    compute = jax.jit(advantages.compute, static_argnames=("num_groups", "cfg"))
    adv = compute(
        batch.rewards, group_ids=batch.group_ids, num_groups=2, cfg=sc.advantage,
        valid=batch.valid, shaping=batch.shaping,
    )  # fmt: skip
    np.testing.assert_allclose(out.advantages, adv.sequence_advantages, atol=1e-6)


@pytest.mark.slow
def test_the_update_measures_router_agreement_from_its_own_forward():
    """mismatch/router_agreement: the update forward's own top-k against the rollout's experts.
    Its own routes: 1. Another model's routes: without replay, exactly a free forward's
    agreement (computed here from `model.forward`'s trace), and the same over micro-batches as
    over one, with replay too; with replay, a 1-layer model's is the free one too (the layer
    sees the same input: the only case the 1-layer model adds, so it runs alone there)."""
    batch, params = _batch(3)
    _, m = _update(_sc(2), params, batch)
    np.testing.assert_allclose(float(m["mismatch/router_agreement"]), 1.0, atol=1e-6)
    for cfg in (CFG, dataclasses.replace(CFG, num_layers=1)):
        batch, params = testing.random_train_batch(
            cfg, num_rows=N, prompt_length=TP, generation_length=TG, seed=5
        )
        other = jax.jit(model_lib.init, static_argnums=0)(cfg, jax.random.key(99))
        forward = jax.jit(model_lib.forward, static_argnums=0)
        free = forward(cfg, other, batch.tokens, attention_mask=batch.attention_mask)
        ids, want = np.asarray(free.router.expert_ids), np.asarray(batch.router.expert_ids)
        same = (ids[..., :, None] == want[..., None, :]).any(-1).mean(-1)  # [B, L, T]
        mask = batch.loss_mask[:, None, :] & (want[..., 0] >= 0)
        expect = same[mask].mean()
        assert expect < 0.95
        cases = (
            [(True, N)] if cfg.num_layers == 1 else [(True, N), (True, 2), (False, N), (False, 2)]
        )
        got = {
            (replay, micro): float(
                _update(_sc(micro, replay=replay, model=cfg), other, batch)[1][
                    "mismatch/router_agreement"
                ]
            )
            for replay, micro in cases
        }
        if cfg.num_layers == 1:
            np.testing.assert_allclose(got[True, N], expect, atol=1e-6)
            continue
        np.testing.assert_allclose(got[False, N], expect, atol=1e-6)
        np.testing.assert_allclose(got[False, 2], expect, atol=1e-6)
        np.testing.assert_allclose(got[True, 2], got[True, N], atol=1e-6)
        # deeper layers see the replayed context, not their own routing's
        assert got[True, N] != pytest.approx(expect, abs=1e-6)


@pytest.mark.slow
def test_correction_reaches_the_loss_and_prepare_reports_it():
    """The train step's loss uses the rollout's log-probs (rejection changes the denominator),
    and prepare's mismatch/* correction metrics match NumPy on the recomputed pi_old."""
    batch, params = _batch(5)
    sc = _sc(4, name="grpo", **CORRECTION, rollout_is_cap=1.05)
    out, m = jax.jit(lambda p, b: train_step.prepare(sc, p, None, b))(params, batch)
    mask = np.asarray(batch.loss_mask)
    log_rho = np.where(mask, np.asarray(out.old_logps) - batch.sampler_logps, 0.0)
    rho = np.exp(log_rho)
    keep = mask & (rho >= 0.9) & (rho <= 1.1)
    seq = np.exp(log_rho.sum(-1) / np.maximum(mask.sum(-1), 1))[:, None] * np.ones_like(rho)
    w = np.minimum(seq, 1.05)
    assert 0 < keep.sum() < mask.sum() and (seq[keep] > 1.05).any()
    want = {
        "is_weight_mean": w[keep].mean(),
        "is_weight_max": w[keep].max(),
        "is_clipped_frac": (seq[keep] > 1.05).mean(),
        "rs_masked_frac": 1 - keep.sum() / mask.sum(),
        "rs_masked_seq_frac": (mask & ~keep).any(-1).sum() / mask.any(-1).sum(),
    }
    for k, v in want.items():
        np.testing.assert_allclose(float(m[f"mismatch/{k}"]), v, rtol=1e-5, err_msg=k)
    # The step's loss: its denominator (GRPO token-mean) is the kept tokens, computed from the
    # batch's old log-probs and the rollout's.
    micro = jax.tree.map(operator.itemgetter(slice(0, 4)), out)
    loss_out = jax.jit(functools.partial(train_step._micro_loss, sc))(params, micro)[1][0]
    old_rho = np.exp(np.asarray(micro.old_logps) - np.asarray(micro.sampler_logps))
    kept = np.asarray(micro.loss_mask) & (old_rho >= 0.9) & (old_rho <= 1.1)
    assert float(loss_out.denominator) == kept.sum() < np.asarray(micro.loss_mask).sum()


@pytest.mark.slow
def test_prepare_sampler_old_logps():
    batch, params = _batch(4)
    sc = dataclasses.replace(_sc(4), old_logps="sampler")
    out, _ = jax.jit(lambda p, b: train_step.prepare(sc, p, None, b))(params, batch)
    np.testing.assert_array_equal(out.old_logps, batch.sampler_logps)


def test_optimizer_schedule():
    opt, lr = train_step.make_optimizer(
        learning_rate=1.0, total_steps=110, warmup_steps=10, end_lr_ratio=0.1
    )
    assert float(lr(0)) == 0.0 and float(lr(5)) == pytest.approx(0.5)
    assert float(lr(10)) == pytest.approx(1.0) and float(lr(110)) == pytest.approx(0.1)


def test_optimizer_settings_at_non_default_values_match_adamw_by_hand():
    """Every OptimizerConfig setting acts, checked against AdamW written out in NumPy: global
    norm clipping, b1, b2, eps, decoupled weight decay (times the learning rate) and a constant
    schedule after a linear warmup. Swapping b1 / b2, dropping the decay or the clip fails."""
    cfg = dict(learning_rate=0.1, warmup_steps=2, schedule="constant", b1=0.5, b2=0.8,
               eps=1e-3, weight_decay=0.3, max_grad_norm=1.5)  # fmt: skip
    opt, lr = train_step.make_optimizer(total_steps=10, **cfg)
    w = np.array([1.0, -2.0, 0.5])
    grads = [np.array([3.0, 0.0, 4.0]), np.array([0.1, -0.2, 0.3]), np.array([-1.0, 2.0, 0.0])]
    params, state = jnp.asarray(w), opt.init(jnp.asarray(w))
    m, v = np.zeros(3), np.zeros(3)
    for t, g in enumerate(grads, start=1):
        updates, state = opt.update(jnp.asarray(g), state, params)
        params = optax.apply_updates(params, updates)
        g = g * min(1.0, 1.5 / np.linalg.norm(g))  # clip_by_global_norm
        m = 0.5 * m + 0.5 * g
        v = 0.8 * v + 0.2 * g**2
        m_hat, v_hat = m / (1 - 0.5**t), v / (1 - 0.8**t)
        step_lr = 0.1 * min((t - 1) / 2, 1.0)  # the count before this update: 0, 0.05, 0.1
        w = w - step_lr * (m_hat / (np.sqrt(v_hat) + 1e-3) + 0.3 * w)
        np.testing.assert_allclose(params, w, rtol=1e-5, atol=1e-6)
    assert float(lr(100)) == pytest.approx(0.1)  # constant after the warmup


@pytest.mark.slow
@pytest.mark.parametrize(
    "micro, loss", [(N, {}), (2, CORRECTION)], ids=["one-micro-batch", "micro-batches+tis"]
)
def test_one_update_takes_pi_old_from_its_own_forward(micro, loss):
    """A step of one update over its whole batch (`fused_old_logps`): `prepare` runs no pi_old
    pass, the update takes pi_old's log-probs and entropies from its own forward (stop-gradient)
    and reports the mismatch; loss, gradient, update and mismatch metrics equal the recomputed
    path's (whose pi_old is a separate forward of the same params), also over micro-batches and
    with sampler correction rejecting tokens."""
    batch, params = _batch(4)
    sc = _sc(micro, name="espo" if not loss else "grpo", **loss)
    fused = dataclasses.replace(sc, fused_old_logps=True)
    prep = lambda sc: jax.jit(functools.partial(train_step.prepare, sc))(params, None, batch)
    (b_re, m_re), (b_fu, m_fu) = prep(sc), prep(fused)
    assert "mismatch/k3_kl" not in m_fu
    np.testing.assert_array_equal(b_fu.advantages, b_re.advantages)
    new_re, u_re = _update(sc, params, b_re)
    new_fu, u_fu = _update(fused, params, b_fu)
    chex.assert_trees_all_close(new_fu.params, new_re.params, atol=2e-6, rtol=1e-5)
    for k in ("loss/loss", "optim/grad_norm", "loss/clip_frac", "mismatch/router_agreement"):
        np.testing.assert_allclose(u_fu[k], u_re[k], rtol=1e-5, atol=1e-6)
    # Token means over the loss tokens and maxima combine exactly over micro-batches; the
    # correction's means over kept tokens or sequences only approximately (token-weighted).
    exact = ("k3_kl", "extreme_token_frac", "abs_dlogp_mean", "is_weight_max", "rs_masked_frac")
    for k in ("unrecorded_routes", *exact):
        if f"mismatch/{k}" in m_re:
            want = m_re[f"mismatch/{k}"]
            np.testing.assert_allclose(u_fu[f"mismatch/{k}"], want, rtol=1e-4, atol=1e-6, err_msg=k)
    assert set(m_re) - set(m_fu) == {
        k for k in u_fu if k.startswith("mismatch/") and k != "mismatch/router_agreement"
    }
    # The ratio is exactly 1 (pi_old is this forward): no PPO KL at all.
    assert float(u_fu["loss/ppo_kl"]) == 0.0


@pytest.mark.slow
def test_trimmed_batch_makes_the_same_update():
    """`batching.trim` drops the columns every row pads, to buckets (prompts <= 3 tokens of a
    16-wide prompt slot: bucket 8; completions <= 5 of 16: bucket 8), and the update is the one
    of the full-width batch: positions count real tokens, the trace moves with its tokens."""
    from espo import generation

    rng = np.random.default_rng(3)
    lengths = (rng.integers(1, 4, N), rng.integers(1, 6, N))
    batch, params = testing.random_train_batch(
        CFG, num_rows=N, prompt_length=16, generation_length=16, lengths=lengths
    )
    trimmed = batching.trim(batch, prompt_length=16, buckets=generation.buckets(16, 16))
    assert trimmed.tokens.shape == (N, 16) and trimmed.router.expert_ids.shape[2] == 16
    assert trimmed.attention_mask.sum() == batch.attention_mask.sum()
    assert trimmed.loss_mask.sum() == batch.loss_mask.sum()
    sc = _sc(4)
    full, m_full = _update(sc, params, batch)
    short, m_short = _update(sc, params, trimmed)
    chex.assert_trees_all_close(full.params, short.params, atol=1e-6, rtol=1e-5)
    np.testing.assert_allclose(m_full["loss/loss"], m_short["loss/loss"], rtol=1e-5)
    # Nothing left to drop: the same batch back.
    assert batching.trim(trimmed, prompt_length=8, buckets=generation.buckets(8, 8)) is trimmed
