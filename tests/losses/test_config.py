"""LossConfig and the errors of espo.losses.

Every invalid LossConfig is refused naming its field (each value just past what is valid), the
edges of what is valid are accepted, the per-loss defaults hold and a registered loss keeps its
function and defaults; compute_loss, aggregate and kl_penalty name the field and what is valid
when an input is missing or misshapen.
"""

import pathlib
import re

import jax.numpy as jnp
import numpy as np
import pytest

from espo import losses, testing, types
from espo.testing import raises_invalid

# tests/ is not a package (pytest runs with --import-mode=importlib): the helpers load by path.
_helpers = testing.load_script(
    pathlib.Path(__file__).with_name("_helpers.py"), name="espo_tests_losses_helpers"
)
random_batch, _batch = _helpers.random_batch, _helpers.one_row_batch


# ---- LossConfig -------------------------------------------------------------------------------


_ESPO = dict(name="espo", vocab_size=10)
_FLOAT0 = "None or a float >= 0"
BAD_CONFIGS = [  # (LossConfig keywords, the field named): each value just past what is valid
    (dict(name="ppo"), "name"),
    (_ESPO | dict(agg="token-mean"), "agg"),
    (_ESPO | dict(clip_low=0.2), "clip_low"),
    (_ESPO | dict(clip_high=0.0), "clip_high"),
    (dict(name="grpo", agg="mean"), "agg"),
    (dict(name="grpo", clip_low=-0.1), "clip_low"),
    (dict(name="grpo", clip_high="0.2"), "clip_high"),
    (dict(name="grpo", clip_high=True), "clip_high"),
    (dict(name="gspo", dual_clip=3.0), "dual_clip"),
    (dict(name="grpo", dual_clip=True), "dual_clip"),
    (dict(name="grpo", dual_clip=1.0), "dual_clip"),
    (dict(name="grpo", norm_length=0), "norm_length"),
    (dict(name="grpo", norm_length=2.0), "norm_length"),
    (_ESPO | dict(top_frac=0.0), "top_frac"),
    (_ESPO | dict(top_frac=1.01), "top_frac"),
    (_ESPO | dict(top_frac=True), "top_frac"),
    (_ESPO | dict(num_entropy_groups=0), "num_entropy_groups"),
    (_ESPO | dict(num_entropy_groups=2.0), "num_entropy_groups"),
    (_ESPO | dict(quantile_scope="global"), "quantile_scope"),
    (_ESPO | dict(alpha=0.0), "alpha"),
    (_ESPO | dict(alpha=True), "alpha"),
    (dict(name="espo"), "vocab_size"),
    (dict(name="grpo", vocab_size=1), "vocab_size"),
    (_ESPO | dict(espo_ratio="token"), "espo_ratio"),
    (dict(name="grpo", kl_coef=-1e-3), "kl_coef"),
    (dict(name="grpo", kl_coef=None), "kl_coef"),
    (dict(name="grpo", kl_estimator="k4"), "kl_estimator"),
    (dict(name="grpo", overlong_filter=1), "overlong_filter"),
    (dict(name="grpo", rollout_is="seq"), "rollout_is"),
    (dict(name="grpo", rollout_is_cap=0.99), "rollout_is_cap"),
    (dict(name="grpo", rollout_is_cap=0.5), "rollout_is_cap"),
    (dict(name="grpo", rollout_is_cap=True), "rollout_is_cap"),
    (dict(name="grpo", rollout_rs="tis"), "rollout_rs"),
    (dict(name="grpo", rollout_rs="token", rollout_rs_high=-0.5), "rollout_rs_high"),
    (dict(name="grpo", rollout_rs="token", rollout_rs_low=-1.0), "rollout_rs_low"),
    (dict(name="grpo", rollout_rs_low=0.5), "rollout_rs_low"),
    (dict(name="grpo", rollout_rs_high=3.0), "rollout_rs_high"),
    (dict(name="grpo", rollout_rs="token", rollout_rs_low=2.0), "rollout_rs_high"),
    (dict(name="grpo", rollout_rs="icepop", rollout_rs_low=6.0), "rollout_rs_high"),
    (dict(name="grpo", rollout_rs="token", rollout_rs_low=1.0, rollout_rs_high=1.0),
     "rollout_rs_high"),
]  # fmt: skip


@pytest.mark.parametrize("kwargs, field", BAD_CONFIGS, ids=lambda x: str(x)[:40])
def test_an_invalid_config_is_refused_naming_the_field(kwargs, field):
    with raises_invalid(field, where="LossConfig"):
        losses.LossConfig(**kwargs)


def test_configs_at_the_edges_of_what_is_valid_are_accepted():
    edges = [
        dict(name="grpo", clip_low=0.0, clip_high=0, dual_clip=1.001, norm_length=1, kl_coef=0),
        _ESPO | dict(vocab_size=2, top_frac=1.0, num_entropy_groups=1, alpha=1e-9),
        dict(name="gspo", rollout_is="token", rollout_is_cap=1.0, rollout_rs="token",
             rollout_rs_low=0.0, rollout_rs_high=1e-9),
    ]  # fmt: skip
    for kwargs in edges:
        cfg = losses.LossConfig(**kwargs)
        assert all(getattr(cfg, k) == v for k, v in kwargs.items())


def test_per_loss_defaults():
    grpo, gspo = losses.LossConfig(name="grpo"), losses.LossConfig(name="gspo")
    assert (grpo.eps_low, grpo.eps_high, grpo.agg_mode) == (0.2, 0.2, "token-mean")
    assert (gspo.eps_low, gspo.eps_high, gspo.agg_mode) == (3e-4, 4e-4, "seq-mean-token-mean")
    assert losses.LossConfig(name="gspo", clip_high=1e-3).eps_high == 1e-3
    assert losses.LossConfig(name="cispo").eps_high == 0.28


def test_a_registered_loss_keeps_its_function_and_defaults():
    def audit_pg(cfg, batch):
        num = -(batch.advantages * batch.logps * batch.mask).sum()
        return types.LossOutput(numerator=num, denominator=jnp.float32(2.0), metrics={})

    try:
        assert (
            losses.register("audit_pg", clip_low=0.1, clip_high=0.3, agg="seq-mean-token-sum")(
                audit_pg
            )
            is audit_pg
        )
        cfg = losses.LossConfig(name="audit_pg")
        assert (cfg.eps_low, cfg.eps_high, cfg.agg_mode) == (0.1, 0.3, "seq-mean-token-sum")
        assert losses.LOSSES["audit_pg"].fn is audit_pg
        out = losses.compute_loss(cfg, **_batch([0.5, -1.0], [2.0, 2.0]))
        # -(2 * (0.5 - 1) + 2 * (-1 - 1)) = 5, over the denominator 2.
        np.testing.assert_allclose(out.numerator, 5.0, rtol=1e-6)
        np.testing.assert_allclose(out.loss, 2.5, rtol=1e-6)
    finally:
        losses.LOSSES.pop("audit_pg", None)


# ---- errors of the functions ------------------------------------------------------------------


def test_errors_name_the_field_and_what_is_valid():
    with raises_invalid("name", where="LossConfig"):
        losses.LossConfig(name="ppo")
    with raises_invalid("agg"):
        losses.aggregate(jnp.ones((1, 2)), jnp.ones((1, 2), bool), agg="sum")
    with raises_invalid("estimator"):
        losses.kl_penalty(logps=jnp.zeros((1, 2)), ref_logps=jnp.zeros((1, 2)), estimator="k4")
    exact = lambda text: pytest.raises(ValueError, match="^" + re.escape(text) + "$")
    grpo = losses.LossConfig(name="grpo")
    with exact("espo needs `entropies` (old-policy token entropies [B, T]); got None"):
        losses.compute_loss(losses.LossConfig(name="espo", vocab_size=8), **_batch([0.1], [1.0]))
    with exact("overlong_filter=True needs `finished` [B] (False = truncated); got None"):
        losses.compute_loss(
            losses.LossConfig(name="grpo", overlong_filter=True), **_batch([0.1], [1.0])
        )
    with exact("rollout_is='token', rollout_rs='none' need `sampler_logps` [B, T]; got None"):
        losses.compute_loss(
            losses.LossConfig(name="grpo", rollout_is="token"), **_batch([0.1], [1.0])
        )
    with exact("logps must be [B, T], got shape (3,)"):
        losses.compute_loss(grpo, **{**_batch([0.1] * 3, [1.0]), "logps": jnp.zeros(3)})
    with exact("finished must be [B]=(1,), got shape (2,)"):
        losses.compute_loss(grpo, **_batch([0.1, 0.2], [1.0, 1.0]), finished=jnp.ones(2, bool))
    # Every per-token input of the wrong shape is named.
    for field in ("old_logps", "mask", "entropies", "ref_logps", "sampler_logps"):
        kw = _batch([0.1, 0.2], [1.0, 1.0])
        kw[field] = jnp.zeros((1, 3))
        with exact(f"{field} must have the shape of logps (1, 2), got (1, 3)"):
            losses.compute_loss(grpo, **kw)


def test_missing_inputs_raise_clear_errors():
    batch = random_batch(9)
    del batch["entropies"]
    with pytest.raises(ValueError, match="entropies"):
        losses.compute_loss(losses.LossConfig(name="espo", vocab_size=10), **batch)
    with pytest.raises(ValueError, match="ref_logps"):
        losses.compute_loss(losses.LossConfig(name="grpo", kl_coef=0.1), **batch)
    with pytest.raises(ValueError, match="advantages"):
        losses.compute_loss(losses.LossConfig(name="grpo"), **{**batch, "advantages": np.ones(3)})
