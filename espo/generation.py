"""The trainer's `generate` callback of `zero_variance.fill_batch`: one step's rollouts, scored,
shaped and laid out as the batch's rows (`Generator`), and the length buckets they use."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from espo import batching, rollout, sampler, scheduling, zero_variance
from espo.data import examples as examples_lib
from espo.rewards import shaping


def buckets(max_prompt_length: int, max_new_tokens: int) -> scheduling.LengthBuckets:
    """The rollout's and the batch's length buckets: geometric from 8 up to each maximum."""
    top = lambda n: sorted(set(scheduling.geometric_buckets(min_size=min(8, n), max_size=n)) | {n})
    return scheduling.LengthBuckets(
        prompt_buckets=top(max_prompt_length), generation_buckets=top(max_new_tokens)
    )


class Generator:
    """The `generate` callback of `zero_variance.fill_batch` for one step: rollouts -> Groups.

    Each call samples and scores with `rollout.generate_and_score`, shapes the rewards, and
    returns the call's `zero_variance.Groups` straight from the Rollout arrays: group ids,
    shaped and verifier rewards, reward_ok, and the rows in the batch's fixed widths
    (`batching.rollout_rows`, Tp + Tg), so `batching.make_train_batch` takes the batch table
    as it is and a carried-over group keeps the arrays of the policy that sampled it.
    """

    def __init__(self, *, s, stage, handle, params, pool, host, encode, stop, key, Tp, Tg,
                 reward_model=None):  # fmt: skip
        self.s, self.stage, self.handle, self.params, self.pool = s, stage, handle, params, pool
        self.reward_model = reward_model  # model_rewards.RewardModelRewards or None
        self.host, self.encode, self.key, self.Tp, self.Tg = host, encode, key, Tp, Tg
        self.parts: list[tuple[rollout.RolloutResult, np.ndarray]] = []
        self.config = rollout.RolloutSpec(
            sampling=sampler.SamplingParams(
                max_new_tokens=stage.max_new_tokens,
                temperature=s.rollout.temperature,
                top_p=s.rollout.top_p,
                top_k=s.rollout.top_k,
                **stop,
            ),
            buckets=buckets(s.max_prompt_length, stage.max_new_tokens),
            max_chunk_size=s.rollout.max_chunk_size,
            schedule=s.rollout.schedule,
            prefill_cost=s.rollout.prefill_cost,
            steps_per_check=s.rollout.steps_per_check,
            overlap_rewards=s.rollout.overlap_rewards,
        )
        r = s.reward
        self.shaping = shaping.ShapingConfig(
            overlong_weight=r.overlong_weight,
            max_length=stage.max_new_tokens,
            cache_length=max(1, int(round(stage.max_new_tokens * r.overlong_cache_fraction))),
            repetition_weight=r.repetition_weight,
            ngram_size=r.ngram_size,
            repetition_threshold=r.repetition_threshold,
        )

    def __call__(self, exs: list[examples_lib.Example], sizes: np.ndarray) -> zero_variance.Groups:
        res = rollout.generate_and_score(
            self.handle,
            self.params,
            prompts=[self.encode(e) for e in exs],
            prompt_texts=[e.prompt for e in exs],
            metas=[e.meta for e in exs],
            group_sizes=[int(g) for g in sizes],
            key=jax.random.fold_in(self.key, len(self.parts)),
            config=self.config,
            reward_pool=self.pool,
            predictor=self.host.predictor,
            prompt_ids=[e.id for e in exs],
            # rollout.detokenize="host": the baseline of the system table, serial on the host
            detokenize=self.pool.detokenize if self.s.rollout.detokenize == "host" else None,
        )
        r = res.rollout
        verifier = np.asarray(r.rewards, np.float32)
        rows = batching.rollout_rows(
            r, prompt_length=self.Tp, generation_length=self.Tg, pad_id=self.config.sampling.pad_id
        )
        reward, verifiable = verifier, None  # the reward advantages normalise (before shaping)
        true_rewards = None  # the verifier's, kept when `reward` is something else
        if self.reward_model is not None:  # a learned RM's rewards; the verifier measures them
            correct = np.nan_to_num(verifier) > self.s.advantage.success_threshold
            reward, verifiable, rm_metrics = self.reward_model(
                rows["tokens"], rows["attention_mask"], np.asarray(r.group_ids), correct
            )
            res = dataclasses.replace(res, metrics={**res.metrics, **rm_metrics})
            true_rewards = verifier  # what train/accuracy reads off carried groups
        if self.s.reward.shuffle:  # the shuffled-reward control: permuted over the valid rows
            key = jax.random.fold_in(jax.random.fold_in(self.key, 2**20), len(self.parts))
            reward = shuffled(reward, np.asarray(r.reward_ok), key)
            true_rewards = verifier
        rep = self.shaping.repetition_weight > 0
        shaped, _ = shaping.shape_rewards(
            np.nan_to_num(reward), lengths=np.asarray(r.lengths),
            token_ids_or_texts=np.asarray(r.tokens) if rep else None, cfg=self.shaping,
        )  # fmt: skip
        self.parts.append((res, shaped))
        return zero_variance.Groups(
            prompt_ids=tuple(e.id for e in exs),
            group_ids=np.asarray(r.group_ids),
            rewards=shaped,
            raw_rewards=reward,
            valid=np.asarray(r.reward_ok),
            verifiable=verifiable,
            true_rewards=true_rewards,
            rows=rows,
        )

    def metrics(self, batch: zero_variance.Groups) -> dict[str, float]:
        """train/* over every generated row; rollout/* timings summed over calls, rest averaged.

        A step served wholly from carried-over groups generated nothing: its train/ reward and
        accuracy are those of the `batch` it trains on (the curriculum reads the accuracy).
        """
        thr = self.s.advantage.success_threshold
        rs = [res.rollout for res, _ in self.parts]
        if rs:
            ok = np.concatenate([np.asarray(r.reward_ok, bool) for r in rs])
            verifier = np.concatenate([np.asarray(r.rewards, np.float32) for r in rs])[ok]
        else:  # served wholly from carried-over groups
            verifier = batch.measured_rewards[batch.valid]
        out = {
            "train/reward_mean": float(verifier.mean()) if verifier.size else 0.0,
            "train/accuracy": float((verifier > thr).mean()) if verifier.size else 0.0,
        }
        if not rs:
            return out | {"train/generated_tokens": 0.0, "train/rollouts": 0.0}
        shaped = np.concatenate([s for _, s in self.parts])[ok]
        lengths = np.concatenate([np.asarray(r.lengths) for r in rs])
        out |= {
            "train/shaped_reward_mean": float(shaped.mean()) if shaped.size else 0.0,
            "train/response_length": float(lengths.mean()),
            "train/generated_tokens": float(lengths.sum()),
            "train/rollouts": float(lengths.size),
        }
        keys = {k for res, _ in self.parts for k in res.metrics}
        for k in keys:
            vals = [res.metrics[k] for res, _ in self.parts if k in res.metrics]
            out[k] = float(np.sum(vals) if k.endswith("_s") else np.mean(vals))
        return out


def shuffled(rewards: np.ndarray, ok: np.ndarray, key) -> np.ndarray:
    """`rewards` with the values of the `ok` rows permuted among those rows (by `key`)."""
    out, rows = rewards.copy(), np.flatnonzero(ok)
    out[rows] = rewards[rows][np.asarray(jax.random.permutation(key, len(rows)))]
    return out
