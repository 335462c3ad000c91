"""Hand-derived numbers for espo.losses, jitted and not (chex variants), with asymmetric values.

Each case states its formula, its source and the numbers worked by hand; where a plausible bug
gives a different number, that wrong answer is noted next to the right one. Every case uses
non-default, asymmetric settings (eps_low != eps_high, token-level advantages of both signs,
ragged rows) so that swapping two hyper-parameters or two operands changes the result.
"""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from espo import losses

TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.mark.slow
class HandTest(parameterized.TestCase):
    def run_loss(self, cfg, logps, **kw):
        """(loss, d loss / d logps, LossOutput) of compute_loss under the current variant."""
        cfg = losses.LossConfig(**cfg)

        @self.variant
        def f(logps, kw):
            def loss(lp):
                out = losses.compute_loss(cfg, logps=lp, **kw)
                return out.loss, out

            (value, out), grad = jax.value_and_grad(loss, has_aux=True)(logps)
            return value, grad, out

        kw = {k: jnp.asarray(v, jnp.float32) for k, v in kw.items()}
        value, grad, out = f(jnp.asarray(logps, jnp.float32), kw)
        return float(value), np.asarray(grad), {k: float(v) for k, v in out.metrics.items()}, out

    # ---- KL penalty ---------------------------------------------------------------------------
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(
        # d = logp - ref = [0.5, -1]. Documented direction KL(pi || pi_ref), samples from pi
        # (Schulman, "Approximating KL divergence"; verl kl_penalty names):
        # k1 = d = [0.5, -1]; grad 1.
        ("k1", "k1", [0.5, -1.0], [1.0, 1.0]),
        # k2 = d^2 / 2 = [0.125, 0.5]; grad d = [0.5, -1].
        ("k2", "k2", [0.125, 0.5], [0.5, -1.0]),
        # k3 = exp(ref - logp) - (ref - logp) - 1 = exp(-d) + d - 1 (verl low_var_kl)
        #    = [0.606531 - 0.5, 2.718282 - 2] = [0.106531, 0.718282]; grad 1 - exp(-d)
        #    = [0.393469, -1.718282].
        # Wrong (log ratio sign flipped, exp(d) - d - 1, the estimate of KL(pi_ref || pi)):
        # values [0.148721, 0.367879], grad exp(d) - 1 = [0.648721, -0.632121]. With d = +-0.5
        # the two per-token values only swap and the mean agrees; d = [0.5, -1] separates them.
        ("k3", "k3", [math.exp(-0.5) - 0.5, math.e - 2.0], [1 - math.exp(-0.5), 1 - math.e]),
    )
    def test_kl_per_token_values_and_gradient(self, estimator, values, grads):
        ref = jnp.array([[-1.5, -0.5]])

        @self.variant
        def kl(logps):
            return losses.kl_penalty(logps=logps, ref_logps=ref, estimator=estimator)

        logps = jnp.array([[-1.0, -1.5]])
        np.testing.assert_allclose(kl(logps), [values], **TOL)
        np.testing.assert_allclose(jax.grad(lambda x: kl(x).sum())(logps), [grads], **TOL)
        # Through compute_loss: r = 1 and A = 0, so the loss is kl_coef * token-mean(k) and the
        # gradient kl_coef * dk / 2; a third, padded token holding -inf must change nothing.
        cfg = dict(name="grpo", kl_coef=0.3, kl_estimator=estimator, clip_low=0.1, clip_high=0.3)
        loss, grad, m, _ = self.run_loss(
            cfg,
            [[-1.0, -1.5, -np.inf]],
            old_logps=[[-1.0, -1.5, 0.0]],
            advantages=[0.0],
            mask=[[1, 1, 0]],
            ref_logps=[[-1.5, -0.5, np.inf]],
        )
        assert abs(loss - 0.3 * np.mean(values)) < 1e-6
        np.testing.assert_allclose(grad, [[0.15 * grads[0], 0.15 * grads[1], 0.0]], **TOL)
        assert abs(m["kl"] - np.mean(values)) < 1e-6

    # ---- clip bounds --------------------------------------------------------------------------
    @chex.variants(with_jit=True, without_jit=True)
    def test_grpo_asymmetric_clip_and_dual_clip(self):
        # verl compute_policy_loss_vanilla, eps_low = 0.1, eps_high = 0.3: range [0.9, 1.3];
        # l = max(-A r, -A clip(r)), token-mean over 6 tokens. Per token (r, A):
        #   (0.85, -1): max(0.85, 0.9) = 0.9    clipped low (grad 0)
        #   (1.25, +1): max(-1.25, -1.25) = -1.25 inside (grad -A r = -1.25)
        #   (0.60, -1): max(0.6, 0.9) = 0.9     clipped low
        #   (1.40, +1): max(-1.4, -1.3) = -1.3  clipped high
        #   (1.50, -1): max(1.5, 1.3) = 1.5     A<0 above the range is never clipped (grad 1.5)
        #   (0.50, +1): max(-0.5, -0.9) = -0.5  A>0 below the range is never clipped (grad -0.5)
        # sum 0.25 -> 0.041667; grad [0, -1.25, 0, 0, 1.5, -0.5] / 6.
        # Swapped eps (range [0.7, 1.1]) gives tokens 0, 1 as 0.85 and -1.1 instead: sum 0.35.
        ratio = np.array([[0.85, 1.25, 0.6, 1.4, 1.5, 0.5]])
        adv = np.array([[-1.0, 1.0, -1.0, 1.0, -1.0, 1.0]])
        kw = dict(old_logps=-np.log(ratio), advantages=adv, mask=np.ones((1, 6)))
        cfg = dict(name="grpo", clip_low=0.1, clip_high=0.3)
        loss, grad, m, _ = self.run_loss(cfg, np.zeros((1, 6)), **kw)
        assert abs(loss - 0.25 / 6) < 1e-6
        np.testing.assert_allclose(grad, [[0, -1.25 / 6, 0, 0, 1.5 / 6, -0.5 / 6]], **TOL)
        assert abs(m["clip_frac_low"] - 2 / 6) < 1e-6 and abs(m["clip_frac_high"] - 1 / 6) < 1e-6
        # Dual clip c = 1.4, only where A < 0: l = min(l, -A c) = min(l, 1.4): token 4 -> 1.4
        # (grad 0). Applied to A > 0 too, token 1 would become min(-1.25, -1.4) = -1.4.
        # sum 0.15 -> 0.025; grad [0, -1.25, 0, 0, 0, -0.5] / 6; dual_clip_frac 1/6.
        loss, grad, m, _ = self.run_loss({**cfg, "dual_clip": 1.4}, np.zeros((1, 6)), **kw)
        assert abs(loss - 0.15 / 6) < 1e-6
        np.testing.assert_allclose(grad, [[0, -1.25 / 6, 0, 0, 0, -0.5 / 6]], **TOL)
        assert abs(m["dual_clip_frac"] - 1 / 6) < 1e-6

    @chex.variants(with_jit=True, without_jit=True)
    def test_gspo_asymmetric_clip(self):
        # GSPO Eq. 3 / verl compute_policy_loss_gspo, eps_low = 0.05, eps_high = 0.1: [0.95, 1.1].
        # Row 0: log r = log 0.92 + [0.1, -0.1] -> s = 0.92, A = -1: max(0.92, 0.95) = 0.95,
        #   clipped low (grad 0). Swapped eps ([0.9, 1.05]) leaves it unclipped at 0.92.
        # Row 1: log r = log 1.08 + [0.2, 0, -0.2] -> s = 1.08, A = +1: max(-1.08, -1.1) = -1.08
        #   inside (grad -A s / 3 per token). Swapped eps clips it at 1.05.
        # seq-mean-token-mean: (0.95 - 1.08) / 2 = -0.065; row-1 grads -1.08 / 3 / 2 = -0.18.
        log_r = np.array([[math.log(0.92) + 0.1, math.log(0.92) - 0.1, 0.0], [0.2, 0.0, -0.2]])
        log_r[1] += math.log(1.08)
        cfg = dict(name="gspo", clip_low=0.05, clip_high=0.1)
        loss, grad, m, _ = self.run_loss(
            cfg,
            log_r,
            old_logps=np.zeros((2, 3)),
            advantages=[-1.0, 1.0],
            mask=[[1, 1, 0], [1, 1, 1]],
        )
        assert abs(loss + 0.065) < 1e-6
        np.testing.assert_allclose(grad, [[0, 0, 0], [-0.18, -0.18, -0.18]], **TOL)
        assert abs(m["clip_frac_low"] - 0.4) < 1e-6 and m["clip_frac_high"] == 0.0

    @chex.variants(with_jit=True, without_jit=True)
    def test_cispo_asymmetric_clip(self):
        # CISPO (MiniMax-M1 Eq. 4): l = -sg[clip(r, 1 - eps_low, 1 + eps_high)] A logp, token-mean.
        # eps_low = 0.3, eps_high = 0.1: r = [0.5, 0.8, 1.2] -> w = [0.7, 0.8, 1.1];
        # logp = [-1, -2, -0.5], A = +1: l = [0.7, 1.6, 0.55] -> 2.85 / 3 = 0.95;
        # grad -w A / 3 = [-0.7, -0.8, -1.1] / 3. Swapped (w = [0.9, 0.9, 1.2]) gives 1.0.
        logps = np.array([[-1.0, -2.0, -0.5]])
        cfg = dict(name="cispo", clip_low=0.3, clip_high=0.1)
        loss, grad, m, _ = self.run_loss(
            cfg,
            logps,
            old_logps=logps - np.log([[0.5, 0.8, 1.2]]),
            advantages=[1.0],
            mask=np.ones((1, 3)),
        )
        assert abs(loss - 0.95) < 1e-6
        np.testing.assert_allclose(grad, [[-0.7 / 3, -0.8 / 3, -1.1 / 3]], **TOL)
        assert abs(m["clip_frac_low"] - 1 / 3) < 1e-6 and abs(m["clip_frac_high"] - 1 / 3) < 1e-6

    # ---- ESPO ---------------------------------------------------------------------------------
    @chex.variants(with_jit=True, without_jit=True)
    def test_espo_aggregation_over_groups_and_sequences(self):
        # Eq. 5 (docs/formulas.md §2.7): loss = mean_i mean_{non-empty g} mean_{t in g} l_t over
        # sequences with a valid token. r = 1 everywhere, so l_t = -A_t (token advantages),
        # top_frac = 0.4: group 0 = the ceil(0.4 n) highest entropies.
        #   row 0: e = [2, .1, .5, .2, .3], L = [1, 2, 3, 4, 5]: ceil(2) = 2 -> g0 = {t0, t2}
        #          mean (1 + 3) / 2 = 2; g1 = {2, 4, 5} mean 11/3; row = (2 + 11/3) / 2 = 17/6
        #   row 1: one token, L = 7: ceil(0.4) = 1 -> g0 only (g1 empty) -> 7
        #   row 2: no valid token (a failed sample): leaves the mean
        #   row 3: e = [1, 3, 2], L = [1, 1, 4]: ceil(1.2) = 2 -> g0 = {t1, t2} mean 2.5,
        #          g1 = {t0} mean 1; row = 1.75
        # num = 17/6 + 7 + 1.75 = 11.583333, den = 3. Wrong answers: den = 4 (counting the
        # failed row) 2.896; an empty group counted (row 1 = 3.5) 2.694; token-mean within the
        # row (row 0 = 3) 3.917.
        # grad_t = -A_t s_g / (|g| K_i den) with s_g = 1, i.e. L_t / (|g| K_i 3).
        nan = np.nan
        loss_table = np.array(
            [[1, 2, 3, 4, 5], [7, nan, nan, nan, nan], [9, 9, 9, 9, 9], [1, 1, 4, nan, nan]]
        )
        entropies = np.array(
            [[2, 0.1, 0.5, 0.2, 0.3], [1, nan, 0, 0, 0], [5, 5, 5, 5, 5], [1, 3, 2, nan, nan]]
        )
        mask = ~np.isnan(loss_table) & (np.arange(4) != 2)[:, None]
        cfg = dict(name="espo", vocab_size=30, top_frac=0.4, alpha=0.05)
        loss, grad, m, out = self.run_loss(
            cfg,
            np.full((4, 5), -1.0),
            old_logps=np.full((4, 5), -1.0),
            advantages=-loss_table,
            mask=mask,
            entropies=entropies,
        )
        assert abs(float(out.numerator) - (17 / 6 + 7 + 1.75)) < 1e-5
        assert float(out.denominator) == 3.0
        assert abs(loss - (17 / 6 + 8.75) / 3) < 1e-6
        size_k = np.array([[4, 6, 4, 6, 6], [1, 0, 0, 0, 0], [0] * 5, [2, 4, 4, 0, 0]])
        want = np.where(mask, np.nan_to_num(loss_table) / np.maximum(size_k, 1) / 3, 0.0)
        np.testing.assert_allclose(grad, want, **TOL)
        assert (m["num_tokens_group0"], m["num_tokens_group1"]) == (5.0, 4.0)

    @chex.variants(with_jit=True, without_jit=True)
    def test_espo_tie_joins_higher_group_and_eps_from_mean_entropy(self):
        # Entropies [0.5, 2, 2, 1, 0.2], top_frac 0.2: ceil(0.2 * 5) = 1 token quota, threshold
        # = the largest entropy 2.0; both 2.0 tokens reach it and join group 0 (a tie joins the
        # higher group, `entropy_groups`), so g0 = {t1, t2}, g1 = {t0, t3, t4}.
        # Eq. 8 (mean-entropy reading, docs/formulas.md §2.4): eps_g = alpha mean_g(e)/log|V|, with
        # alpha = 0.05, |V| = 20 (log 20 = 2.995732):
        #   eps_0 = 0.05 * 2 / 2.995732 = 0.033381; eps_1 = 0.05 * (1.7 / 3) / 2.995732 = 0.009458.
        # (Tie to the lower group: g1 = {2, .5, 1, .2}, eps_1 = 0.015439, and s_1 below would not
        # clip; eps without / log|V|: 0.1 and 0.02833.)
        # Ratios (gspo_token, A = +1): s_0 = 1.03 < 1 + eps_0: l = -1.03 (grad -1.03 / (2 * 2));
        # s_1 = exp(mean log r) = 1.012 > 1 + eps_1: clipped to -1.009458 (grad 0).
        # loss = -(1.03 + 1.009458) / 2 = -1.019729.
        e = np.array([[0.5, 2.0, 2.0, 1.0, 0.2]])
        log_r = np.full((1, 5), math.log(1.012)) + np.array([[0.01, 0, 0, -0.02, 0.01]])
        log_r[0, 1:3] = math.log(1.03)
        cfg = dict(name="espo", vocab_size=20, alpha=0.05, top_frac=0.2)
        loss, grad, m, _ = self.run_loss(
            cfg,
            log_r,
            old_logps=np.zeros((1, 5)),
            advantages=[1.0],
            mask=np.ones((1, 5)),
            entropies=e,
        )
        eps0, eps1 = 0.1 / math.log(20), 0.05 * (1.7 / 3) / math.log(20)
        assert abs(eps0 - 0.033381) < 1e-6 and abs(eps1 - 0.009458) < 1e-6
        assert abs(m["espo_eps_group0"] - eps0) < 1e-6 and abs(m["espo_eps_group1"] - eps1) < 1e-6
        assert (m["num_tokens_group0"], m["num_tokens_group1"]) == (2.0, 3.0)
        assert abs(loss + (1.03 + 1 + eps1) / 2) < 1e-6
        np.testing.assert_allclose(grad, [[0, -1.03 / 4, -1.03 / 4, 0, 0]], **TOL)
        assert (m["clip_frac_group0"], m["clip_frac_group1"]) == (0.0, 1.0)

    # ---- stop-gradients -----------------------------------------------------------------------
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(
        ("grpo", dict(name="grpo", clip_low=0.1, clip_high=0.3, kl_coef=0.2)),
        ("gspo", dict(name="gspo", clip_low=0.05, clip_high=0.1, kl_coef=0.2)),
        ("espo", dict(name="espo", vocab_size=30, alpha=0.5, kl_coef=0.2)),
        ("cispo", dict(name="cispo", kl_coef=0.2)),
    )
    def test_only_logps_carries_gradient(self, cfg):
        # Module contract: old_logps, advantages, entropies and ref_logps are stop-gradient'd, so
        # a caller differentiating through them (e.g. old log-probs from the same params in the
        # first epoch, or advantages computed in-graph) gets the policy gradient only.
        cfg = losses.LossConfig(**cfg)
        rng = np.random.default_rng(3)
        inputs = {
            k: jnp.asarray(rng.normal(-1.0, 0.3, (2, 4)), jnp.float32)
            for k in ("logps", "old_logps", "advantages", "entropies", "ref_logps")
        }
        inputs["entropies"] = jnp.abs(inputs["entropies"])
        mask = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0]], bool)

        @self.variant
        def grads(inputs):
            return jax.grad(lambda x: losses.compute_loss(cfg, **x, mask=mask).loss)(inputs)

        g = grads(inputs)
        assert np.abs(np.asarray(g["logps"])).sum() > 0
        for name in ("old_logps", "advantages", "entropies", "ref_logps"):
            np.testing.assert_array_equal(g[name], 0.0, err_msg=name)

    @chex.variants(with_jit=True, without_jit=True)
    def test_ratio_on_the_bound_is_not_counted_as_clipped(self):
        # verl counts a token as clipped when pg_losses2 > pg_losses1 (torch.gt), strictly: a
        # ratio exactly on the bound gives equal losses and is not clipped. eps_low = eps_high = 0
        # and logp = old put r = exp(0) = 1 exactly on both bounds, for A of both signs; `>=`
        # in either indicator would report clip fractions 1/2.
        cfg = dict(name="grpo", clip_low=0.0, clip_high=0.0)
        zeros = np.zeros((2, 3))
        _, _, m, _ = self.run_loss(
            cfg, zeros, old_logps=zeros, advantages=[1.0, -1.0], mask=np.ones((2, 3))
        )
        assert (m["clip_frac_low"], m["clip_frac_high"], m["clip_frac"]) == (0.0, 0.0, 0.0)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(
        # verl vanilla clamps the token log ratio to [-20, 20] before exp; r = e^20 = 4.85165e8.
        ("grpo", dict(name="grpo", clip_low=0.1, clip_high=0.3), 25.0, math.exp(20.0)),
        # verl GSPO clamps the combined log ratio at 10; s = e^10 = 22026.47.
        ("gspo", dict(name="gspo", clip_low=0.1, clip_high=0.3), 12.0, math.exp(10.0)),
        ("espo", dict(name="espo", vocab_size=30, num_entropy_groups=1), 12.0, math.exp(10.0)),
    )
    def test_ratio_clamps(self, cfg, log_r, clamped):
        # One token, A = -1, log r past the clamp: the pessimistic max keeps the unclipped
        # -A r = r, which is the clamped value, and the clamp passes no gradient. Without the
        # clamp: e^25 = 7.2e10 (or e^12 = 162755) with gradient equal to the value.
        loss, grad, m, _ = self.run_loss(
            cfg,
            [[log_r]],
            old_logps=[[0.0]],
            advantages=[-1.0],
            mask=[[1]],
            entropies=[[1.0]],
        )
        assert abs(loss / clamped - 1.0) < 1e-5
        np.testing.assert_array_equal(grad, [[0.0]])
        assert abs(m["ratio_max"] / clamped - 1.0) < 1e-5

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(
        # GRPO eps 0.2: r = [1, 1.5, 0.5, 1], A = [1, 1, -1, 0]. Token 0 moves; token 1 (A > 0,
        # r > 1.2) and token 2 (A < 0, r < 0.8) are clipped; token 3 has no advantage. Live 1/4.
        # Entropies [0.1, 2, 0.3, 0.2]: group 0 = the top ceil(0.2 * 4) = 1 token (token 1),
        # dead and clipped; group 1 = tokens 0, 2, 3: live 1/3, clipped 1/3 (token 2; token 3
        # has A = 0, so it is dead but not clipped). Counting A = 0 as clipped: 2/3. By advantage
        # mass |A|: group 0 keeps 0 of 1, group 1 keeps 1 of 2 (token 3 weighs nothing).
        ("grpo", dict(name="grpo"), 0.25, (0.0, 1.0, 1 / 3, 1 / 3), (0.0, 0.5)),
        # GSPO (eps 3e-4 / 4e-4): one sequence ratio s = exp(mean log r) = exp((log 1.5 +
        # log 0.5) / 4) = 0.9306 < 1 - 3e-4. For A > 0 min(A s, A clip(s)) = A s (unclipped: tokens
        # 0, 1 move); for A < 0 it is A clip(s) (token 2 clipped); token 3 has A = 0. Live 2/4;
        # group 0 (token 1) live 1, clipped 0; group 1 live 1/3, clipped 1/3. By |A|: 1 and 1/2.
        ("gspo", dict(name="gspo"), 0.5, (1.0, 0.0, 1 / 3, 1 / 3), (1.0, 0.5)),
    )
    def test_gradient_use(self, cfg, live, by_group, by_advantage):
        _, grad, m, _ = self.run_loss(
            dict(cfg, vocab_size=16),
            np.log([[1.0, 1.5, 0.5, 1.0]]),
            old_logps=np.zeros((1, 4)),
            advantages=[[1.0, 1.0, -1.0, 0.0]],
            mask=np.ones((1, 4)),
            entropies=[[0.1, 2.0, 0.3, 0.2]],
        )
        assert abs(m["grad_token_frac"] - live) < 1e-6
        assert abs(m["grad_token_frac"] - (grad != 0).mean()) < 1e-6  # no KL: the loss's own grad
        got = (m["grad_frac_group0"], m["clipped_frac_group0"])
        got += (m["grad_frac_group1"], m["clipped_frac_group1"])
        np.testing.assert_allclose(got, by_group, atol=1e-6)
        got = (m["grad_adv_frac_group0"], m["grad_adv_frac_group1"])
        np.testing.assert_allclose(got, by_advantage, atol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(
        # Row 0 (A = 1, r = 1) moves, row 1 (A = 0) does not; entropies [2, 1.9] and [0.2, 0.1],
        # top_frac 1/2, 2 groups. Per sequence, group 0 = the top token of each row: live 1/2 in
        # both groups; over the batch, group 0 = the 2 highest = row 0: live 1, then 0.
        ("sequence", "sequence", (0.5, 0.5)),
        ("batch", "batch", (1.0, 0.0)),
    )
    def test_gradient_use_groups_follow_the_quantile_scope(self, scope, by_group):
        _, _, m, _ = self.run_loss(
            dict(
                name="grpo", vocab_size=16, top_frac=0.5, num_entropy_groups=2, quantile_scope=scope
            ),
            np.zeros((2, 2)),
            old_logps=np.zeros((2, 2)),
            advantages=[1.0, 0.0],
            mask=np.ones((2, 2)),
            entropies=[[2.0, 1.9], [0.2, 0.1]],
        )
        assert m["grad_token_frac"] == 0.5
        np.testing.assert_allclose((m["grad_frac_group0"], m["grad_frac_group1"]), by_group)
