"""Advantage inversion of a Bradley–Terry reward model and its fix (docs/formulas.md §1.5).

Run:  python experiments/repro_inversion.py [--steps 200] [--seed 0] [--prompts 256]

A synthetic preference task with known true quality. A sequence is a prompt of 4 filler tokens
and a response of 6-10 filler tokens ending in an answer marker, CORRECT or WRONG; a response has
good style when it holds >= 2 STYLE tokens (bad-style ones hold 0 or 1, a distractor). True
quality is q = correct + W_STYLE * style with W_STYLE = 0.1 < 1/G: correctness dominates, so in a
group mixing correct and wrong rollouts the sign of q - mean(q) is the correctness, and in an
all-correct or all-wrong group it is the style. Rollouts of one class have equal quality.

1. Train a BT reward model (tiny espo MoE, a scalar head on its final hidden state;
   `espo.rewards.reward_model`) on pairs ordered by q, with LABEL_NOISE of the labels flipped.
2. Calibrate the dead-zone delta on held-out pairs of equal quality (a tie-labelled validation
   set): delta = the TIE_QUANTILE quantile of their |score difference|.
3. On held-out groups (P prompts x G rollouts; per prompt a correct rate in {0, .25, .5, .75, 1}
   and a style rate in {0, .5, 1}, since RL groups are often all-correct or all-wrong and
   alike), compare advantages from the naive BT score with those from `adjust_rewards`.
Both go through the same group normalisation, `espo.advantages.group_normalized`.

Columns (`espo.rewards.reward_model` defines them): inversion = fraction of rollouts whose
advantage sign contradicts q - mean(q), a rollout of exactly mean quality (every rollout of an
equal-quality group) counting as inverted when its advantage is nonzero; inversion_mixed = the
same over groups holding >= 2 quality levels only; pairwise = fraction of q-ordered pairs whose
advantages are reversed; agreement = fraction of non-mean rollouts given the right sign (the
signal kept); zero_var_groups = fraction of groups whose advantages are all 0.
The row "defaults" is `RmAdjustConfig()` (margin derived from G, DEFAULT_DEAD_ZONE);
"tiered + dead-zone + rank" uses the delta calibrated in step 2 instead.

DEAD_ZONE_SWEEP: `--sweep-dead-zone` evaluates the default adjustment at each delta of DEAD_ZONES
(BT logits). Measured with `python experiments/repro_inversion.py --sweep-dead-zone` (seeds 0-4,
G = 8, 256 groups each, 200 BT steps; mean +- std over seeds):

    dead_zone   inversion        agreement        zero_var_groups
    0.0         0.308 +- 0.014   0.971 +- 0.004   0.000
    0.1         0.239 +- 0.024   0.978 +- 0.006   0.057
    0.3         0.088 +- 0.015   0.992 +- 0.003   0.204
    0.5         0.034 +- 0.018   0.996 +- 0.003   0.256
    0.75        0.015 +- 0.012   0.984 +- 0.009   0.284
    1.0         0.005 +- 0.007   0.964 +- 0.016   0.308
    1.5         0.001 +- 0.002   0.858 +- 0.025   0.388
    2.0         0.000 +- 0.000   0.795 +- 0.026   0.434

Rule: the smallest inversion whose agreement is no worse than without a dead-zone (0.971): 0.75,
which also maximises agreement - inversion. Beyond it the zone swallows real style differences
(the BT gap of an ordered pair is ~log 9 = 2.2 at 10% label noise) and agreement falls.
sigmoid(0.75) = 0.68: pairs the RM prefers with less than 68% probability count as ties.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from espo import advantages, model
from espo.rewards import judge, model_rewards
from espo.rewards import reward_model as rm

PAD, CORRECT, WRONG, STYLE, FILLER = 0, 2, 3, 4, 8  # filler tokens are FILLER..V-1
PROMPT_LEN, MAX_BODY, MIN_BODY = 4, 10, 6
SEQ_LEN = PROMPT_LEN + MAX_BODY + 1
W_STYLE = 0.1
LABEL_NOISE = 0.1
TIE_QUANTILE = 0.9


def model_config(**overrides) -> model.ModelConfig:
    """The tiny MoE (D = 64), one layer, 64-token vocabulary: the task needs no more, and one
    layer keeps compiling and training to a few seconds on 2 CPU cores."""
    return model.ModelConfig.tiny(**{"vocab_size": 64, "num_layers": 1, **overrides})


def sample_responses(rng: np.random.Generator, *, prompts, correct, styled, vocab_size: int):
    """Tokens [N, SEQ_LEN] and mask for prompts [N, PROMPT_LEN] and class bits correct/styled."""
    n = len(correct)
    tokens = np.full((n, SEQ_LEN), PAD, np.int32)
    mask = np.zeros((n, SEQ_LEN), bool)
    for k in range(n):
        body_len = rng.integers(MIN_BODY, MAX_BODY + 1)
        body = rng.integers(FILLER, vocab_size, size=body_len)
        num_style = rng.integers(2, 4) if styled[k] else rng.integers(0, 2)
        body[rng.choice(body_len, size=num_style, replace=False)] = STYLE
        seq = np.concatenate([prompts[k], body, [CORRECT if correct[k] else WRONG]])
        tokens[k, : len(seq)], mask[k, : len(seq)] = seq, True
    return tokens, mask


def quality(correct, styled):
    return np.asarray(correct, np.float32) + W_STYLE * np.asarray(styled, np.float32)


def sample_pairs(rng, num_pairs: int, *, vocab_size: int, ordered: bool = True):
    """Pairs of responses to one prompt: strictly ordered by q with noisy labels (ordered=True),
    or of equal quality (ordered=False, the tie-labelled calibration set)."""
    prompts = rng.integers(FILLER, vocab_size, size=(num_pairs, PROMPT_LEN))
    a_bits = rng.integers(0, 2, size=(2, num_pairs)).astype(bool)
    b_bits = rng.integers(0, 2, size=(2, num_pairs)).astype(bool)
    if ordered:
        same = quality(*a_bits) == quality(*b_bits)
        b_bits[1, same] = ~b_bits[1, same]  # same class: flip b's style to make an ordered pair
    else:
        b_bits = a_bits.copy()
    a, a_mask = sample_responses(
        rng, prompts=prompts, correct=a_bits[0], styled=a_bits[1], vocab_size=vocab_size
    )
    b, b_mask = sample_responses(
        rng, prompts=prompts, correct=b_bits[0], styled=b_bits[1], vocab_size=vocab_size
    )
    a_wins = quality(*a_bits) > quality(*b_bits)
    a_wins ^= rng.random(num_pairs) < LABEL_NOISE
    pick = lambda x, y: np.where(a_wins[:, None], x, y)
    return rm.PreferenceBatch(pick(a, b), pick(b, a), pick(a_mask, b_mask), pick(b_mask, a_mask))


def train(cfg, *, steps: int, batch_size: int, seed: int, lr: float = 3e-3):
    """BT-train the reward model on fresh noisy pairs each step; returns params and metrics."""
    rng = np.random.default_rng(seed)
    # An "rbg" key: compiling `model.init` takes half as long as with threefry, whose random
    # bits are most of it on CPU. Its streams are fixed per seed for one backend and XLA version.
    params = rm.init_reward_model(cfg, jax.random.key(seed, impl="rbg"))
    optimizer = optax.adam(lr)
    opt_state = optimizer.init(params)
    step = rm.make_train_step(cfg, optimizer)
    metrics = {}
    for _ in range(steps):
        batch = sample_pairs(rng, batch_size, vocab_size=cfg.vocab_size)
        params, opt_state, metrics = step(params, opt_state, batch)
    return params, {k: float(v) for k, v in metrics.items()}


def calibrate_dead_zone(
    score, params, *, seed: int, vocab_size: int, num_pairs: int = 512
) -> float:
    """delta = TIE_QUANTILE quantile of |s_a - s_b| over held-out pairs of equal quality."""
    ties = sample_pairs(
        np.random.default_rng(seed + 2), num_pairs, vocab_size=vocab_size, ordered=False
    )
    both = score(
        params,
        np.concatenate([ties.chosen, ties.rejected]),
        np.concatenate([ties.chosen_mask, ties.rejected_mask]),
    )  # [2 * num_pairs]
    return float(np.quantile(np.abs(both[:num_pairs] - both[num_pairs:]), TIE_QUANTILE))


def sample_groups(rng, *, num_prompts: int, group_size: int, vocab_size: int):
    """Held-out groups: tokens [P*G, T], mask, correct [P, G] and quality [P, G]."""
    p_correct = rng.choice([0.0, 0.25, 0.5, 0.75, 1.0], size=(num_prompts, 1))
    p_style = rng.choice([0.0, 0.5, 1.0], size=(num_prompts, 1))
    correct = rng.random((num_prompts, group_size)) < p_correct
    styled = rng.random((num_prompts, group_size)) < p_style
    prompts = np.repeat(
        rng.integers(FILLER, vocab_size, size=(num_prompts, PROMPT_LEN)), group_size, axis=0
    )
    tokens, mask = sample_responses(
        rng, prompts=prompts, correct=correct.ravel(), styled=styled.ravel(), vocab_size=vocab_size
    )
    return tokens, mask, correct, quality(correct, styled)


# The evaluation is jitted as three helpers: ~1 s of compiling on 2 CPU cores, against ~3 s
# for its ~60 small ops run eagerly and ~2.5 s for one jit over all of it.

ROWS = (
    "naive BT",
    "tiered only",
    "dead-zone only",
    "rank only",
    "tiered + rank",
    "tiered + dead-zone + rank",
    "defaults (RmAdjustConfig())",
    "pairwise judge (BT, tie band)",
    "oracle q, adjusted",
)  # the ways of turning RM scores into advantages, in `_advantage_rows` order
ADJUSTED = "tiered + dead-zone + rank"  # the headline row: every step, delta calibrated
DEFAULTS = "defaults (RmAdjustConfig())"
DEAD_ZONES = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0)  # the --sweep-dead-zone grid


def _norm(r):
    return advantages.group_normalized(r, eps=1e-6, scale_by_std=True)


def _adjusted(s, correct, **kw):
    return _norm(rm.adjust_rewards(s, correct=correct, cfg=rm.RmAdjustConfig(**kw)))


@functools.partial(jax.jit, static_argnames="delta")
def _advantage_rows(scores, judged, *, correct, q, delta: float):
    """Advantages [P, G] of each of ROWS from RM scores, judge rewards, correctness, quality."""
    return (
        _norm(scores),
        _adjusted(scores, correct, dead_zone=0.0, rank=False),
        _adjusted(scores, correct, tiered=False, dead_zone=delta, rank=False),
        _adjusted(scores, correct, tiered=False, dead_zone=0.0),
        _adjusted(scores, correct, dead_zone=0.0),
        _adjusted(scores, correct, dead_zone=delta),
        _adjusted(scores, correct),
        _norm(judged),
        _adjusted(q, correct, dead_zone=0.0),  # q is exact: no noise to tie
    )


@jax.jit
def _columns(adv, q):
    """The columns of one row but inversion_mixed, for advantages [P, G] and quality [P, G]."""
    return {
        "inversion": rm.inversion_rate(adv, true_quality=q),
        "pairwise": rm.pairwise_inversion_rate(adv, true_quality=q),
        "agreement": rm.sign_agreement_rate(adv, true_quality=q),
        "zero_var_groups": jnp.mean(jnp.all(jnp.abs(adv) <= 1e-6, axis=-1)),
    }


_inversion_rate = jax.jit(rm.inversion_rate)


def _row(adv, q, mixed) -> dict[str, float]:
    adv = np.asarray(adv)
    out = {k: float(v) for k, v in _columns(adv, q).items()}
    out["inversion_mixed"] = float(_inversion_rate(adv[mixed], true_quality=q[mixed]))
    return out


def evaluate(scores, *, correct, q, delta: float) -> dict[str, dict[str, float]]:
    """Inversion statistics of each way of turning RM scores [P, G] into advantages."""
    judged = judge.judge_groups(scores, judge.FakeJudge(tie_tol=delta)).rewards  # [P, G]
    rows = _advantage_rows(scores, judged, correct=correct, q=q, delta=delta)
    mixed = q.max(-1) > q.min(-1)  # groups holding at least two quality levels
    return {name: _row(adv, q, mixed) for name, adv in zip(ROWS, rows, strict=True)}


_sweep_row = jax.jit(_adjusted, static_argnames="dead_zone")


def sweep_dead_zone(scores, *, correct, q, dead_zones=DEAD_ZONES) -> dict[float, dict]:
    """The default adjustment (tiers, margin from G, ranks) at each dead-zone delta."""
    mixed = q.max(-1) > q.min(-1)
    return {
        float(d): _row(_sweep_row(scores, correct, dead_zone=float(d)), q, mixed)
        for d in dead_zones
    }


def run(
    *,
    steps: int = 200,
    seed: int = 0,
    num_prompts: int = 256,
    group_size: int = 8,
    batch_size: int = 64,
    cfg: model.ModelConfig | None = None,
    sweep: bool = False,
) -> dict:
    """Train, calibrate, evaluate: {"rows", "delta", "train" (last metrics), "cfg", "params",
    "score" (`model_rewards.make_scorer`)}, and "sweep" (`sweep_dead_zone`) when `sweep`."""
    if W_STYLE * group_size >= 1:
        raise ValueError(f"group_size={group_size} needs W_STYLE={W_STYLE} < 1/G")
    cfg = cfg or model_config()
    params, train_metrics = train(cfg, steps=steps, batch_size=batch_size, seed=seed)
    score = model_rewards.make_scorer(cfg, chunk=512)
    delta = calibrate_dead_zone(score, params, seed=seed, vocab_size=cfg.vocab_size)
    rng = np.random.default_rng(seed + 1)
    tokens, mask, correct, q = sample_groups(
        rng, num_prompts=num_prompts, group_size=group_size, vocab_size=cfg.vocab_size
    )
    scores = score(params, tokens, mask).reshape(num_prompts, group_size)
    out = {
        "rows": evaluate(scores, correct=correct, q=q, delta=delta),
        "delta": delta,
        "train": train_metrics,
        "cfg": cfg,
        "params": params,
        "score": score,
    }
    if sweep:
        out["sweep"] = sweep_dead_zone(scores, correct=correct, q=q)
    return out


COLUMNS = ("inversion", "inversion_mixed", "pairwise", "agreement", "zero_var_groups")


def _table(title: str, rows: dict, *, width: int = 40) -> str:
    """Mean (and std over seeds when there are several) of each column of each row."""
    lines = [f"{title:{width}s}" + "".join(f"{c:>20s}" for c in COLUMNS)]
    for name, per_seed in rows.items():
        cells = []
        for c in COLUMNS:
            v = np.array([r[c] for r in per_seed])
            cells.append(f"{v.mean():.4f} +- {v.std():.4f}" if len(v) > 1 else f"{v[0]:.4f}")
        lines.append(f"{str(name):{width}s}" + "".join(f"{x:>20s}" for x in cells))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument(
        "--sweep-dead-zone", action="store_true", help="also sweep the default's dead-zone"
    )
    args = parser.parse_args()
    results = []
    for seed in args.seeds:
        t0 = time.perf_counter()
        result = run(
            steps=args.steps, seed=seed, num_prompts=args.prompts, group_size=args.group_size,
            sweep=args.sweep_dead_zone,
        )  # fmt: skip
        tr = result["train"]
        print(
            f"seed {seed}: BT training {args.steps} steps, last batch loss {tr['bt_loss']:.3f}, "
            f"accuracy {tr['accuracy']:.2f} (label noise {LABEL_NOISE}); calibrated dead-zone "
            f"delta {result['delta']:.3f}; {time.perf_counter() - t0:.1f} s"
        )
        results.append(result)
    seeds = f"seeds {', '.join(map(str, args.seeds))}"
    print(f"\nmean +- std over {seeds}; G = {args.group_size}, {args.prompts} groups each")
    per_row = {name: [r["rows"][name] for r in results] for name in ROWS}
    print(_table("rewards -> group-normalised advantages", per_row))
    if args.sweep_dead_zone:
        per_delta = {f"dead_zone={d}": [r["sweep"][d] for r in results] for d in DEAD_ZONES}
        print(
            "\n" + _table(f"defaults, dead_zone swept (default {rm.DEFAULT_DEAD_ZONE})", per_delta)
        )
    mean = lambda name, col: np.mean([r["rows"][name][col] for r in results])
    naive = mean("naive BT", "inversion")
    for name in (ADJUSTED, DEFAULTS):
        adjusted = mean(name, "inversion")
        print(
            f"inversion rate: naive {naive:.4f} -> {name} {adjusted:.4f} "
            f"({naive / max(adjusted, 1e-12):.1f}x lower); sign agreement "
            f"{mean('naive BT', 'agreement'):.4f} -> {mean(name, 'agreement'):.4f}"
        )


if __name__ == "__main__":
    main()
