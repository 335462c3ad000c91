"""Tests for espo.train_step: token log-probs / entropies against independent recomputes, router
replay reproducing the sampler, padding, detached entropies, and the entropy-source option."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from espo import advantages, model, sampler, scheduling, train_step
from espo.testing import raises_invalid

CFG = model.ModelConfig.tiny(vocab_size=64)
B, T = 3, 9


@functools.cache
def params():
    return model.init(CFG, jax.random.key(0))


# One compile per (shape, temperature) shared by the tests (the machine is small).
token_logps = jax.jit(train_step.token_logps, static_argnums=0, static_argnames="temperature")
forward = jax.jit(functools.partial(model.forward, CFG))


def inputs():
    """Left-padded rows (3, 0 and 5 padding tokens), random ids."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(2, 64, (B, T)), jnp.int32)
    mask = jnp.arange(T)[None, :] >= jnp.array([[3], [0], [5]])  # [B, T]
    return tokens, mask


def reference(tokens, mask, temperature=1.0):
    """Plain recompute: log_softmax of model.forward's logits (float64 numpy), gathered at the
    next token; entropy -sum p log p. Returns aligned [B, T] arrays and the meaningful mask."""
    logits = np.asarray(forward(params(), tokens, attention_mask=mask).logits)
    z = logits.astype(np.float64)[:, :-1] / temperature  # [B, T-1, V]
    logp = z - z.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    taken = np.take_along_axis(logp, np.asarray(tokens)[:, 1:, None], -1)[..., 0]
    entropy = -(np.exp(logp) * logp).sum(-1)
    m = np.asarray(mask)
    real = np.zeros((B, T), bool)
    real[:, 1:] = m[:, 1:] & m[:, :-1]
    pad = np.zeros((B, 1))
    return np.concatenate([pad, taken], 1), np.concatenate([pad, entropy], 1), real


@pytest.mark.slow
class TokenLogpsTest(parameterized.TestCase):
    @chex.variants(with_jit=True)  # as the update runs it (op by op: ~150 small compiles)
    def test_equals_a_plain_recompute(self):
        temperature = 0.7  # 1.0 is covered by the sampler replay test
        tokens, mask = inputs()
        f = self.variant(functools.partial(train_step.token_logps, CFG, temperature=temperature))
        logps, entropies, _ = f(params(), tokens, mask)
        want_logps, want_entropies, real = reference(tokens, mask, temperature)
        chex.assert_shape((logps, entropies), (B, T))
        assert logps.dtype == entropies.dtype == jnp.float32
        np.testing.assert_allclose(np.where(real, logps, 0), np.where(real, want_logps, 0),
                                   atol=1e-5)  # fmt: skip
        np.testing.assert_allclose(
            np.where(real, entropies, 0), np.where(real, want_entropies, 0), atol=1e-5
        )
        # Not meaningful (t = 0, padding, the first real prompt token): exactly 0.
        np.testing.assert_array_equal(np.asarray(logps)[~real], 0.0)
        np.testing.assert_array_equal(np.asarray(entropies)[~real], 0.0)
        assert (np.asarray(entropies) >= 0).all()
        assert (np.asarray(entropies)[real] <= np.log(CFG.vocab_size) + 1e-5).all()
        # Entropies are not log-probs (the continued-row bug of issue 13 #8 swapped them).
        assert not np.allclose(np.asarray(entropies)[real], -np.asarray(logps)[real], atol=1e-2)
        # The temperature reaches the softmax (the untempered recompute is far from it).
        untempered, _, _ = reference(tokens, mask, 1.0)
        assert np.abs(np.asarray(logps)[real] - untempered[real]).max() > 1e-2


@pytest.mark.slow
def test_padding_tokens_reach_no_real_position():
    # Whatever ids the padding holds, the log-probs / entropies of real positions are the same.
    tokens, mask = inputs()
    want = token_logps(CFG, params(), tokens, mask)
    got = token_logps(CFG, params(), jnp.where(mask, tokens, 63), mask)
    chex.assert_trees_all_close(got.logps, want.logps, atol=1e-6)
    chex.assert_trees_all_close(got.entropies, want.entropies, atol=1e-6)


@pytest.mark.slow
def test_logps_carry_the_gradient_and_entropies_do_not():
    tokens, mask = inputs()
    routing = forward(params(), tokens, attention_mask=mask).router

    def parts(p):
        cur = train_step.token_logps(CFG, p, tokens, mask)
        old = train_step.old_logps(CFG, p, tokens, mask, routing)
        return jnp.stack([cur.logps.sum(), cur.entropies.sum(), old.logps.sum()])  # [3]

    # One forward, a pullback per part, not jacrev: on GPU the MoE dispatch is
    # `jax.lax.ragged_dot`, which has no batching rule for jacrev's vmap over the cotangent
    # (NotImplementedError on an H200).
    def grads(p):
        _, pull = jax.vjp(parts, p)
        return [pull(jnp.eye(3)[i])[0] for i in range(3)]

    g_logps, g_entropies, g_old = jax.jit(grads)(params())
    assert any(np.abs(np.asarray(x)).sum() > 0 for x in jax.tree.leaves(g_logps))
    assert all(not np.asarray(x).any() for x in jax.tree.leaves(g_entropies))
    assert all(not np.asarray(x).any() for x in jax.tree.leaves(g_old))


@pytest.mark.slow
def test_replaying_the_rollout_reproduces_the_sampler():
    # The sampler's logps[t] come from the logits at t-1 of the decode, temperature-scaled;
    # old_logps over training_inputs() with the rollout's trace replayed gives the same numbers
    # at every sampled token, and the same entropies. Tolerance 1e-4: cached decode vs a full
    # forward (module tolerance of STYLE.md). Temperature 1 (0.7 is checked above).
    temperature = 1.0
    prompts = np.random.RandomState(0).randint(2, 64, (2, 6))
    out = sampler.sample(
        CFG, params(), prompts, np.array([6, 3]), key=jax.random.key(1), num_samples=2,
        max_new_tokens=7, temperature=temperature, stop_ids=(1,), pad_id=0,
        buckets=scheduling.LengthBuckets(prompt_buckets=(8,), generation_buckets=(8,)),
    )  # fmt: skip
    tokens, mask = out.training_inputs()
    Tp = out.prompt_tokens.shape[1]
    old = jax.jit(train_step.old_logps, static_argnums=0)(CFG, params(), tokens, mask, out.router)
    m = np.asarray(out.mask)
    assert m.sum() > 8  # real completions to compare
    got_logps = np.asarray(train_step.completion(old.logps, prompt_length=Tp))
    got_entropies = np.asarray(train_step.completion(old.entropies, prompt_length=Tp))
    np.testing.assert_allclose(got_logps[m], np.asarray(out.logps)[m], atol=1e-4)
    np.testing.assert_allclose(got_entropies[m], np.asarray(out.entropies)[m], atol=1e-4)
    # Free routing over the same tokens is another computation; replay is what matches (this
    # tiny model's routing is close to ties, so the free recompute drifts).
    free = token_logps(CFG, params(), tokens, mask)
    assert free.logps.shape == old.logps.shape


def test_entropy_config_and_selection():
    assert train_step.EntropyConfig() == train_step.EntropyConfig(espo="old", rl_zvp="current")
    with raises_invalid("espo", where="EntropyConfig"):
        train_step.EntropyConfig(espo="current")  # ESPO's Eq. 6 is pi_old's entropy
    with pytest.raises(ValueError, match=r"EntropyConfig.rl_zvp='new'"):
        train_step.EntropyConfig(rl_zvp="new")
    old, samp, cur = jnp.ones((1, 2)), 2 * jnp.ones((1, 2)), 3 * jnp.ones((1, 2))
    pick = functools.partial(train_step.select_entropies, old=old, sampler=samp, current=cur)
    assert float(pick("old")[0, 0]) == 1.0 and float(pick("sampler")[0, 0]) == 2.0
    assert float(pick("current")[0, 0]) == 3.0
    with pytest.raises(ValueError, match="'current' was selected but its entropies"):
        train_step.select_entropies("current", old=old)
    grad = jax.grad(lambda c: train_step.select_entropies("current", current=c).sum())(cur)
    np.testing.assert_array_equal(grad, 0.0)


@pytest.mark.slow
def test_rl_zvp_with_current_entropies_from_the_training_forward():
    # The wiring the trainer uses: per-row advantages (+ zvp_sign) from advantages.compute on
    # the host batch, token advantages from the current policy's entropies in the loss forward.
    # Rows 0, 1: group 0, all wrong (RL-ZVP); row 2: group 1, alone (no signal: 0).
    tokens, mask = inputs()
    cur = token_logps(CFG, params(), tokens, mask)
    out = advantages.compute(
        jnp.array([0.0, 0.0, 1.0]), group_ids=jnp.array([0, 0, 1]), num_groups=2,
        cfg=advantages.AdvantageConfig(rl_zvp=True),
    )  # fmt: skip
    h = train_step.select_entropies("current", current=cur.entropies)
    adv = advantages.token_advantages(
        out.sequence_advantages, out.zvp_sign, entropies=h, mask=mask, alpha=0.1
    )
    e, m = np.asarray(cur.entropies), np.asarray(mask)
    h_max = np.where(m[0], e[0], -np.inf).max()
    np.testing.assert_allclose(np.asarray(adv[0])[m[0]], (-0.1 * (h_max - e[0]))[m[0]], atol=1e-6)
    np.testing.assert_array_equal(np.asarray(adv[2]), 0.0)
    assert float(out.metrics["adv/num_no_signal_groups"]) == 1.0
    np.testing.assert_array_equal(np.asarray(adv)[~m], 0.0)
