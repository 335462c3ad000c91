"""Group-relative advantages over ragged groups: GRPO / Dr.GRPO, shaping, validity and RL-ZVP.

Owns the map from rewards to advantages. Rows are flat, [N], each with a `group_ids` entry in
[0, num_groups); groups may have any size (adaptive G) because every group statistic is a segment
reduction (`jax.ops.segment_sum` with a static `num_segments`). Token quantities are [N, T].
`compute_dense` is the [P, G] convenience (group p = row p). Everything is float32, jittable
(`num_groups` and `cfg` static) and free of gradient: advantages are constants of the loss.

The rules (issue 7; `compute` implements them, `zero_variance` uses the same ones on the host):
  1. Validity. A row with `valid` False (its reward call failed) or a group id outside
     [0, num_groups) contributes nothing: it is left out of every mean, std, max and min, of
     zero-variance detection, and gets advantage 0. Its reward may hold anything (NaN, inf): it
     is replaced by 0 with `jnp.where` before any arithmetic. A group with fewer than 2 valid
     rows has no baseline, so no signal: every advantage in it is 0 (counted in the metrics).
  2. Zero-variance is judged on the VERIFIER rewards (before shaping) of the valid rows:
     max - min <= atol (DAPO filters on accuracy, docs/formulas.md §5). Shaping never makes a group
     "informative".
  3. Advantage = normalised verifier reward + centred shaping (shaping NEVER divided by std):
       A_i = (r_i - mean_g r) / (std_g r + eps)   [GRPO; std unbiased, ddof 1, as torch.std]
           | (r_i - mean_g r)                     [Dr.GRPO, scale_by_std=False]
             (0 in a zero-variance group: its reward carries no signal)
           + (s_i - mean_g s)                      [shaping s, e.g. the overlong penalty]
     so shaping moves an advantage by at most its own spread. Example (the issue's): an
     all-wrong group of 8, one response 2 tokens into DAPO's soft overlong band (L_cache 256):
     r = [0 x8], s = [0 x7, -2/256]; mean s = -0.0009766, so A = [+0.0009766 x7, -0.0068359].
     Normalising the shaped rewards instead (the old rule) gave +0.354 and -2.475.
     "rft" (a control, not a policy-gradient estimator): A_i = 1 if r_i > success_threshold
     else 0 in every group, zero-variance ones included, no shaping and no RL-ZVP: one on-policy
     update with it is online rejection-sampling fine-tuning (the NLL of the correct samples,
     RAFT / ReST style, token-averaged over all sampled tokens).
  4. RL-ZVP (arXiv 2509.21880, docs/formulas.md §1.2), with cfg.rl_zvp: a zero-variance group
     in which every valid row is `verifiable` takes the entropy-shaped token advantage
     (`rl_zvp_tokens`), on top of its centred shaping; "correct" means mean_g r >
     success_threshold:
       correct: A_{i,t} = alpha H_{i,t};  wrong: A_{i,t} = -alpha (max_{k valid} H_{i,k} - H_{i,t})
     Only a verifier knows absolute correctness: a zero-variance group with an unverifiable row
     (a judge's tie, whose r = 0 means "no preference", not "wrong") gets no RL-ZVP; it is left
     to zero-variance elimination (its reward part is 0).
  5. Entropies H are detached. Which policy's entropy (the current one, recomputed in the
     training forward, as the paper defines; pi_old; or the sampler's) is the caller's choice:
     `compute` takes them if it has them, otherwise it returns the per-row part and `zvp_sign`,
     and the train step calls `token_advantages` with its own entropies (see espo.train_step).

Padding tokens (mask False) get 0 and never reach a max or a sum, whatever they hold.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from espo import errors


@dataclasses.dataclass(frozen=True)
class Estimator:
    """How an estimator turns a group's rewards into per-row advantages (`compute`).

    `advantages(rewards, st, cfg)` -> (signal [N] bool: rows that carry an advantage,
    advantages [N]); `group_relative` estimators subtract the group mean, so their zero-variance
    groups get 0, shaping is added centred, and (with `cfg.rl_zvp`) RL-ZVP may give those groups
    token advantages; the others score each row on its own.
    """

    advantages: Callable
    group_relative: bool = True
    scale_by_std: bool = False


ESTIMATORS: dict[str, Estimator] = {}


def register(name: str, **traits):
    """Decorator: adds `fn(rewards, st, cfg) -> (signal, advantages)` as estimator `name`."""

    def add(fn):
        ESTIMATORS[name] = Estimator(fn, **traits)
        return fn

    return add


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdvantageConfig:
    """How rewards become advantages (hashable: a static argument of the jitted `compute`)."""

    # "grpo": (r - mean) / (std + eps); "dr_grpo": r - mean; "rft": 1 if r > success_threshold
    # else 0, whatever the group (online rejection-sampling fine-tuning, a control)
    estimator: str = "grpo"
    eps: float = 1e-6  # added to the std (outside the square root), GRPO only
    atol: float = 1e-6  # verifier rewards within atol (max - min) make a zero-variance group
    rl_zvp: bool = False  # zero-variance verifiable groups take RL-ZVP token advantages
    rl_zvp_alpha: float = 0.1  # RL-ZVP's alpha (paper's best 0.1)
    success_threshold: float = 0.0  # RL-ZVP: a group is "correct" when mean reward > this

    def __post_init__(self) -> None:
        checks = {
            "estimator": (self.estimator in ESTIMATORS, f"one of {tuple(ESTIMATORS)}"),
            "eps": (_is_real(self.eps) and self.eps >= 0, "a float >= 0"),
            "atol": (_is_real(self.atol) and self.atol >= 0, "a float >= 0"),
            "rl_zvp": (isinstance(self.rl_zvp, bool), "a bool"),
            "rl_zvp_alpha": (_is_real(self.rl_zvp_alpha) and self.rl_zvp_alpha >= 0, ">= 0"),
            "success_threshold": (_is_real(self.success_threshold), "a float"),
        }
        errors.check(self, checks)

    @property
    def scale_by_std(self) -> bool:
        return ESTIMATORS[self.estimator].scale_by_std


_is_real = errors.is_real


@flax.struct.dataclass
class AdvantageOutput:
    """What `compute` returns (a pytree: usable inside and outside `jit`).

    Attributes:
      advantages: float32 [N] per row, or [N, T] per token when entropies or a mask were given;
        0 on invalid rows, rows of no-signal groups and padding tokens.
      sequence_advantages: float32 [N], the per-row part (normalised verifier reward + centred
        shaping), without RL-ZVP; what `token_advantages` adds the RL-ZVP term to.
      zvp_sign: int32 [N], +1 / -1 on valid rows of groups that take RL-ZVP (correct / wrong),
        0 elsewhere (also 0 everywhere unless cfg.rl_zvp).
      zero_variance_groups: bool [num_groups], groups with >= 2 valid rows and no verifier spread.
      no_signal_groups: bool [num_groups], groups with rows but fewer than 2 valid ones.
      metrics: float32 [] counts by name ("adv/..."), see `compute`.
    """

    advantages: Float[Array, " N"] | Float[Array, "N T"]
    sequence_advantages: Float[Array, " N"]
    zvp_sign: Int[Array, " N"]
    zero_variance_groups: Bool[Array, " num_groups"]
    no_signal_groups: Bool[Array, " num_groups"]
    metrics: dict[str, Float[Array, ""]]


class _Stats(flax.struct.PyTreeNode):
    """Per-group statistics of the valid rows, gathered back to rows ([N] each)."""

    valid: Bool[Array, " N"]  # valid and with a group id in range
    seg: Int[Array, " N"]  # group id, clipped into range (only meaningful where valid)
    count: Float[Array, " G"]  # valid rows per group
    present: Bool[Array, " G"]  # groups with at least one row (valid or not)


def _group_stats(group_ids, valid, num_groups: int) -> _Stats:
    group_ids = jnp.asarray(group_ids, jnp.int32)
    in_range = (group_ids >= 0) & (group_ids < num_groups)  # [N]
    valid = in_range & jnp.asarray(valid, bool)  # [N]
    seg = jnp.clip(group_ids, 0, num_groups - 1)  # [N]
    count = jax.ops.segment_sum(valid.astype(jnp.float32), seg, num_groups)  # [G]
    present = jax.ops.segment_max(in_range.astype(jnp.int32), seg, num_groups) > 0  # [G]
    return _Stats(valid=valid, seg=seg, count=count, present=present)


def _centred(values, st: _Stats):
    """(values - mean over the group's valid rows) [N], 0 on invalid rows; values as given."""
    x = jnp.where(st.valid, values, 0.0)  # [N] select before arithmetic: padding may be NaN
    total = jax.ops.segment_sum(x, st.seg, st.count.shape[0])  # [G]
    mean = total / jnp.maximum(st.count, 1.0)  # [G]
    return jnp.where(st.valid, x - mean[st.seg], 0.0)  # [N]


def _std(centred, st: _Stats):
    """Unbiased (ddof 1) std per group [G] from valid centred values; 0 with < 2 valid rows."""
    sq = jax.ops.segment_sum(centred * centred, st.seg, st.count.shape[0])  # [G]
    return jnp.sqrt(sq / jnp.maximum(st.count - 1.0, 1.0))  # [G]


def _spread(values, st: _Stats):
    """max - min over each group's valid rows [G] (0 for a group with no valid row)."""
    G = st.count.shape[0]
    hi = jax.ops.segment_max(jnp.where(st.valid, values, -jnp.inf), st.seg, G)  # [G]
    lo = jax.ops.segment_min(jnp.where(st.valid, values, jnp.inf), st.seg, G)  # [G]
    return jnp.where(st.count > 0, hi - lo, 0.0)  # [G]


@register("grpo", scale_by_std=True)
def _grpo(rewards, st: _Stats, cfg):
    """(r - mean) / (std + eps) over the group's valid rows (groups of >= 2 valid rows)."""
    centred = _centred(rewards, st)  # [N]
    return st.valid & (st.count >= 2)[st.seg], centred / (_std(centred, st)[st.seg] + cfg.eps)


@register("dr_grpo")
def _dr_grpo(rewards, st: _Stats, cfg):
    """r - mean (Dr. GRPO: no division by the std)."""
    del cfg
    return st.valid & (st.count >= 2)[st.seg], _centred(rewards, st)


@register("rft", group_relative=False)
def _rft(rewards, st: _Stats, cfg):
    """1 if r > success_threshold else 0, whatever the group (online rejection-sampling FT)."""
    return st.valid, (rewards > cfg.success_threshold).astype(jnp.float32)


def normalize(
    rewards: Float[Array, " N"],
    *,
    group_ids: Int[Array, " N"],
    num_groups: int,
    valid: Bool[Array, " N"] | None = None,
    eps: float = 1e-6,
    scale_by_std: bool = True,
) -> Float[Array, " N"]:
    """A_i = (R_i - mean_g) / (std_g + eps) over ragged groups (segment ops), the GRPO advantage.

    mean and std (unbiased, ddof 1, as torch.std in verl and TRL) are over the valid rows of each
    group; invalid rows and groups with fewer than 2 valid rows get 0 (never NaN). With
    scale_by_std=False this is Dr.GRPO's R - mean. No zero-variance handling here: an exact tie
    gives 0 / eps = 0; `compute` also zeroes ties within atol. Hand example: R = [1, 0, 0, 1],
    mean 0.5, var = 4 * 0.25 / 3, std 0.57735 -> A = +-0.5 / (0.57735 + 1e-6) = +-0.866024.
    """
    rewards = jax.lax.stop_gradient(jnp.asarray(rewards, jnp.float32))
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be flat [N], got shape {rewards.shape}")
    valid = jnp.ones(rewards.shape, bool) if valid is None else valid
    st = _group_stats(group_ids, valid, num_groups)
    centred = _centred(rewards, st)  # [N]
    signal = st.valid & (st.count[st.seg] >= 2)  # [N]
    if scale_by_std:
        centred = centred / (_std(centred, st)[st.seg] + eps)  # [N]
    return jnp.where(signal, centred, 0.0)


def rl_zvp_tokens(
    zvp_sign: Int[Array, " N"],
    *,
    entropies: Float[Array, "N T"],
    mask: Bool[Array, "N T"],
    alpha: float,
) -> Float[Array, "N T"]:
    """RL-ZVP's token advantage (arXiv 2509.21880; docs/formulas.md §1.2) where zvp_sign != 0.

      zvp_sign = +1 (all correct):  A_{i,t} =  alpha H_{i,t}
      zvp_sign = -1 (all wrong):    A_{i,t} = -alpha (max_{k: mask} H_{i,k} - H_{i,t})
      zvp_sign =  0:                A_{i,t} = 0
    H is detached. Padding (mask False) is replaced before any arithmetic and gets 0. Example:
    alpha 0.1, H = [0.5, 1.0, 2.0] -> correct [0.05, 0.1, 0.2], wrong [-0.15, -0.1, 0.0].
    """
    sign = jnp.asarray(zvp_sign)[:, None]  # [N, 1]
    m = jnp.asarray(mask).astype(bool)  # [N, T]
    h = jnp.where(m, jax.lax.stop_gradient(jnp.asarray(entropies, jnp.float32)), 0.0)  # [N, T]
    h_max = jnp.max(jnp.where(m, h, -jnp.inf), axis=-1, keepdims=True)  # [N, 1]
    h_max = jnp.where(jnp.any(m, axis=-1, keepdims=True), h_max, 0.0)  # [N, 1]
    zvp = jnp.where(sign > 0, alpha * h, -alpha * (h_max - h))  # [N, T]
    return jnp.where(m & (sign != 0), zvp, 0.0)  # [N, T]


def token_advantages(
    sequence_advantages: Float[Array, " N"],
    zvp_sign: Int[Array, " N"],
    *,
    entropies: Float[Array, "N T"],
    mask: Bool[Array, "N T"],
    alpha: float,
) -> Float[Array, "N T"]:
    """sequence_advantages broadcast over tokens plus `rl_zvp_tokens`; 0 on padding.

    The train step's entry point: call it with the entropies chosen by `entropy_source` (by
    default the current policy's, detached, from the same forward as the training log-probs).
    """
    m = jnp.asarray(mask).astype(bool)  # [N, T]
    seq = jnp.asarray(sequence_advantages, jnp.float32)[:, None]  # [N, 1]
    zvp = rl_zvp_tokens(zvp_sign, entropies=entropies, mask=m, alpha=alpha)  # [N, T]
    return jnp.where(m, seq + zvp, 0.0)  # [N, T]


def compute(
    rewards: Float[Array, " N"],
    *,
    group_ids: Int[Array, " N"],
    num_groups: int,
    cfg: AdvantageConfig,
    valid: Bool[Array, " N"] | None = None,
    shaping: Float[Array, " N"] | None = None,
    verifiable: Bool[Array, " N"] | None = None,
    entropies: Float[Array, "N T"] | None = None,
    mask: Bool[Array, "N T"] | None = None,
) -> AdvantageOutput:
    """Advantages of flat rows under the module's rules 1-5.

    Jittable with `num_groups` and `cfg` static: `jax.jit(compute, static_argnames=("num_groups",
    "cfg"))` (`compute_jit` is that); every shape is static, no value is indexed by a mask.

    Args:
      rewards: [N] VERIFIER rewards (before shaping); anything on invalid rows.
      group_ids: [N] int, the group (prompt) of each row; ids outside [0, num_groups) are
        treated as padding rows (invalid).
      num_groups: static upper bound on the number of groups (segments).
      valid: [N] bool, False where the reward failed (Rollout.reward_ok); default all True.
      shaping: [N] the shaping term (shaped reward - verifier reward); default 0.
      verifiable: [N] bool, False for rewards without absolute correctness (a judge); default
        all True. Only matters for RL-ZVP.
      entropies: [N, T] detached token entropies for RL-ZVP; with them (and `mask`) the result
        is per token [N, T]. Without them the result is per row and RL-ZVP is left to
        `token_advantages` (the trainer's path with current-policy entropies).
      mask: [N, T] bool token mask; needed with entropies; alone, it broadcasts the per-row
        advantages over tokens (0 on padding).

    Metrics (float32 counts): "adv/num_groups" (groups with at least one row),
    "adv/num_zero_variance_groups", "adv/num_rl_zvp_groups", "adv/num_no_signal_groups",
    "adv/num_unverifiable_zero_variance_groups", "adv/num_invalid" (rows whose group id is in
    range but whose reward failed), "adv/num_rl_zvp_rows".
    """
    rewards = jax.lax.stop_gradient(jnp.asarray(rewards, jnp.float32))
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be flat [N], got shape {rewards.shape}")
    (N,) = rewards.shape
    flags = {"group_ids": group_ids, "valid": valid, "shaping": shaping, "verifiable": verifiable}
    for name, value in flags.items():
        if value is not None and jnp.shape(value) != (N,):
            raise ValueError(f"{name} must be [N]={(N,)} like rewards, got {jnp.shape(value)}")
    if entropies is not None and mask is None:
        raise ValueError("entropies need a token mask [N, T]")
    for name, value in (("entropies", entropies), ("mask", mask)):
        if value is not None and (jnp.ndim(value) != 2 or jnp.shape(value)[0] != N):
            raise ValueError(f"{name} must be [N, T] with N={N}, got {jnp.shape(value)}")
    if entropies is not None and jnp.shape(entropies) != jnp.shape(mask):
        raise ValueError(f"entropies {jnp.shape(entropies)} and mask {jnp.shape(mask)} differ")

    st = _group_stats(group_ids, jnp.ones((N,), bool) if valid is None else valid, num_groups)
    signal_group = st.count >= 2  # [G]
    zero_variance = signal_group & (_spread(rewards, st) <= cfg.atol)  # [G]
    no_signal = st.present & ~signal_group  # [G]

    estimator = ESTIMATORS[cfg.estimator]
    signal, reward_adv = estimator.advantages(rewards, st, cfg)  # [N], [N]
    if estimator.group_relative:
        reward_adv = jnp.where(zero_variance[st.seg], 0.0, reward_adv)  # [N]
        if shaping is not None:
            shaping = jax.lax.stop_gradient(jnp.asarray(shaping, jnp.float32))
            reward_adv = reward_adv + _centred(shaping, st)  # [N] never divided by the std
    sequence = jnp.where(signal, reward_adv, 0.0)  # [N]

    unverifiable = jnp.zeros((num_groups,), bool)
    if verifiable is not None:
        bad = st.valid & ~jnp.asarray(verifiable, bool)  # [N]
        unverifiable = jax.ops.segment_max(bad.astype(jnp.int32), st.seg, num_groups) > 0
    zvp_group = zero_variance & ~unverifiable & cfg.rl_zvp & estimator.group_relative  # [G]
    mean_reward = jax.ops.segment_sum(jnp.where(st.valid, rewards, 0.0), st.seg, num_groups)
    correct = mean_reward / jnp.maximum(st.count, 1.0) > cfg.success_threshold  # [G]
    sign = jnp.where(correct, 1, -1)[st.seg]  # [N]
    zvp_sign = jnp.where(st.valid & zvp_group[st.seg], sign, 0).astype(jnp.int32)  # [N]

    if entropies is not None:
        adv = token_advantages(
            sequence, zvp_sign, entropies=entropies, mask=mask, alpha=cfg.rl_zvp_alpha
        )  # [N, T]
    elif mask is not None:
        adv = jnp.where(jnp.asarray(mask, bool), sequence[:, None], 0.0)  # [N, T]
    else:
        adv = sequence
    in_range = (jnp.asarray(group_ids) >= 0) & (jnp.asarray(group_ids) < num_groups)  # [N]
    count = lambda x: jnp.sum(x).astype(jnp.float32)
    metrics = {
        "adv/num_groups": count(st.present),
        "adv/num_zero_variance_groups": count(zero_variance),
        "adv/num_rl_zvp_groups": count(zvp_group),
        "adv/num_no_signal_groups": count(no_signal),
        "adv/num_unverifiable_zero_variance_groups": count(zero_variance & unverifiable),
        "adv/num_invalid": count(in_range & ~st.valid),
        "adv/num_rl_zvp_rows": count(zvp_sign != 0),
    }
    return AdvantageOutput(
        advantages=adv,
        sequence_advantages=sequence,
        zvp_sign=zvp_sign,
        zero_variance_groups=zero_variance,
        no_signal_groups=no_signal,
        metrics=metrics,
    )


compute_jit = jax.jit(compute, static_argnames=("num_groups", "cfg"))


def dense_group_ids(num_prompts: int, group_size: int) -> Int[Array, " N"]:
    """[P * G] group ids of a prompt-major [P, G] layout: p for rows p*G .. p*G + G - 1."""
    return jnp.repeat(jnp.arange(num_prompts, dtype=jnp.int32), group_size)


def compute_dense(
    rewards: Float[Array, "P G"],
    *,
    cfg: AdvantageConfig,
    valid: Bool[Array, "P G"] | None = None,
    shaping: Float[Array, "P G"] | None = None,
    verifiable: Bool[Array, "P G"] | None = None,
    entropies: Float[Array, "P G T"] | None = None,
    mask: Bool[Array, "P G T"] | None = None,
) -> AdvantageOutput:
    """`compute` on a dense [P, G] layout (group p = row p); outputs reshaped to [P, G(, T)]."""
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [P, G], got shape {rewards.shape}")
    P, G = rewards.shape
    flat = lambda x, n: None if x is None else jnp.reshape(jnp.asarray(x), (P * G, *n))
    tokens_like = mask if entropies is None else entropies
    tok = () if tokens_like is None else (jnp.shape(tokens_like)[-1],)
    out = compute(
        rewards.reshape(P * G),
        group_ids=dense_group_ids(P, G),
        num_groups=P,
        cfg=cfg,
        valid=flat(valid, ()),
        shaping=flat(shaping, ()),
        verifiable=flat(verifiable, ()),
        entropies=flat(entropies, tok),
        mask=flat(mask, tok),
    )
    return out.replace(
        advantages=out.advantages.reshape(P, G, *tok),
        sequence_advantages=out.sequence_advantages.reshape(P, G),
        zvp_sign=out.zvp_sign.reshape(P, G),
    )


# ---------------------------------------------------------------- dense shortcuts


def group_normalized(
    rewards: Float[Array, "P G"], *, eps: float = 1e-6, scale_by_std: bool = True
) -> Float[Array, "P G"]:
    """`normalize` on a dense [P, G] layout: A = (R - mean_p) / (std_p + eps), GRPO's advantage.

    Hand example (test_advantages): R = [0, 0, 0, -1/4096]: mean -1/16384, std (ddof 1)
    2/16384 = 1.2207e-4 -> A = [0.4959 x3, -1.4878]; eps inside the square root would give
    [0.0606 x3, -0.1817]. G == 1 and exact ties give 0, never NaN.
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [P, G], got shape {rewards.shape}")
    return _group_normalized(rewards, eps=eps, scale_by_std=scale_by_std)


# Jitted: called on host arrays (the RM stage's inversion metrics every step), op by op it
# compiled ~10 small programs for each new shape.
@functools.partial(jax.jit, static_argnames=("eps", "scale_by_std"))
def _group_normalized(rewards: Float[Array, "P G"], *, eps: float, scale_by_std: bool):
    P, G = rewards.shape
    flat = normalize(
        rewards.reshape(P * G),
        group_ids=dense_group_ids(P, G),
        num_groups=P,
        eps=eps,
        scale_by_std=scale_by_std,
    )  # [P * G]
    return flat.reshape(P, G)


def zero_variance_mask(rewards: Float[Array, "P G"], *, atol: float = 1e-6) -> Bool[Array, " P"]:
    """True for each prompt whose G rewards all lie within `atol` of each other (max - min).

    A dense shortcut without validity (G == 1 counts as zero-variance: no spread); `compute`
    reports `zero_variance_groups` (>= 2 valid rows) and `no_signal_groups` separately.
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [P, G], got shape {rewards.shape}")
    return (rewards.max(-1) - rewards.min(-1)) <= atol


def rl_zvp(
    rewards: Float[Array, "P G"],
    entropies: Float[Array, "P G T"],
    mask: Bool[Array, "P G T"] | Float[Array, "P G T"],
    *,
    alpha: float = 0.1,
    eps: float = 1e-6,
    atol: float = 1e-6,
    scale_by_std: bool = True,
) -> AdvantageOutput:
    """`compute_dense` with RL-ZVP on and every row valid and verifiable: token advantages
    [P, G, T] (see the module docstring, rule 4) and `zero_variance_groups` [P]."""
    cfg = AdvantageConfig(
        estimator="grpo" if scale_by_std else "dr_grpo",
        eps=eps,
        atol=atol,
        rl_zvp=True,
        rl_zvp_alpha=alpha,
    )
    entropies = jnp.asarray(entropies, jnp.float32)
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.ndim != 2 or entropies.ndim != 3 or entropies.shape[:2] != rewards.shape:
        raise ValueError(
            f"rewards must be [P, G] and entropies [P, G, T]; got {rewards.shape}, "
            f"{entropies.shape}"
        )
    if jnp.shape(mask) != entropies.shape:
        raise ValueError(
            f"mask must have the shape of entropies {entropies.shape}, got {jnp.shape(mask)}"
        )
    return compute_dense(rewards, cfg=cfg, entropies=entropies, mask=jnp.asarray(mask) != 0)
