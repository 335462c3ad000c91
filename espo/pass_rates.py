"""Offline pass rates: the share of correct samples of every training prompt, before RL.

The offline stage of zero-variance elimination ("Each Prompt Matters"; the difficulty filtering
of DAPO / Polaris recipes): `estimate(config)` samples `num_samples` completions of each training
prompt with the policy RL starts from (`model.init_from` or `model.hf_path`), at the rollout's
temperature, top-p, largest budget and activation dtype (without FP8), scores them with the
run's verifier and returns a `zero_variance.PassRateTable` (a sample passes when its reward is >
advantage.success_threshold).

  python experiments/pass_rates.py --config configs/default.py \\
      --config.model.init_from=runs/warm --samples 16 --out runs/pass_rates.json
  python experiments/run.py --config configs/default.py --config.model.init_from=runs/warm \\
      --config.zve.pass_rate_table=runs/pass_rates.json

A run given the table starts its pass-rate history from it (rate x N passes, (1 - rate) x N
failures: `PassRateHistory.from_table`), so the pre-filter and adaptive G act from the first step;
the online history then updates it as usual. Take N >= 10 with the default thresholds: through
the history's Beta(0.5, 0.5) prior an always-solved prompt reads (N + 0.5) / (N + 1), under
zve.prefilter_high = 0.95 when N < 10. An estimate that stops part way resumes from its
output file: prompts already in it (same policy and N) are not sampled again.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib

import jax
import ml_collections
import tqdm

from espo import config as config_lib
from espo import errors, evaluate, trainer, zero_variance
from espo import model as model_lib
from espo.data import sources
from espo.data import tokenizer as tokenizer_lib


def estimate(
    config: ml_collections.ConfigDict,
    *,
    num_samples: int,
    max_prompts: int = 0,
    out: str | os.PathLike | None = None,
    prompts_per_call: int = 32,
    progress: bool = False,
) -> zero_variance.PassRateTable:
    """The pass rates of the first `max_prompts` training prompts that fit
    data.max_prompt_length (0: all) under the policy a run of `config` starts RL from; written to
    `out` (atomically, after every `prompts_per_call` prompts) when given, and resumed from it."""
    s = config_lib.Settings.from_config(config)
    if s.sft.steps and not (s.init_from or s.hf_path):
        raise config_lib.ConfigError(
            "--config.model", "init_from", "",
            f"the warm start's workdir: this config warm-starts with sft.steps={s.sft.steps}, "
            "and the pass rates are those of the policy RL starts from",
        )  # fmt: skip
    if not (errors.is_int(num_samples) and num_samples >= 1):
        raise errors.InvalidValue("estimate", "num_samples", num_samples, "an int >= 1")
    if not (errors.is_int(max_prompts) and max_prompts >= 0):
        raise errors.InvalidValue("estimate", "max_prompts", max_prompts, "an int >= 0 (0: all)")
    if not s.rollout.temperature > 0:
        raise config_lib.ConfigError(
            "--config.rollout", "temperature", s.rollout.temperature,
            "> 0: greedy rollouts give every prompt a pass rate of 0 or 1",
        )  # fmt: skip
    tok = tokenizer_lib.load_tokenizer(s.hf_path)
    key = jax.random.key(s.seed)
    model_cfg, params = trainer.initial_model(s, jax.random.fold_in(key, 0))
    tokenizer_lib.check_vocab(tok, model_cfg.vocab_size)
    train_src = sources.make_sources(s.data)[0]
    fits = lambda e: len(tok.encode_prompt(e.prompt)) <= s.max_prompt_length
    exs = [e for e in (train_src[i] for i in range(len(train_src))) if fits(e)]
    exs = exs[:max_prompts] if max_prompts else exs
    if not exs:
        raise config_lib.ConfigError(
            "--config.data", "max_prompt_length", s.max_prompt_length,
            f"a length that some of the {len(train_src)} training prompts fit",
        )  # fmt: skip
    handle = model_lib.Model(
        dataclasses.replace(model_cfg, dtype=s.rollout.dtype or model_cfg.dtype)
    )
    cfg = evaluate.EvalConfig(
        samples=num_samples, temperature=s.rollout.temperature,
        max_new_tokens=s.curriculum.max_new_tokens,
        batch_size=num_samples * min(prompts_per_call, len(exs)),
    )  # fmt: skip
    sampling_kw = dict(stop_ids=tuple(tok.stop_ids), pad_id=tok.pad_id, top_p=s.rollout.top_p)
    tag = s.init_from or s.hf_path or f"initialised with seed {s.seed}"
    path = pathlib.Path(out) if out is not None else None
    table = zero_variance.PassRateTable.load(path) if path and path.exists() else None
    if table and (table.policy_tag, table.num_samples) != (tag, num_samples):
        raise FileExistsError(
            f"{path} holds pass rates of policy_tag={table.policy_tag!r} with "
            f"{table.num_samples} samples, not {tag!r} with {num_samples}; delete it or choose "
            "another --out"
        )
    reward_fn, bar = trainer.reward_fn_of(s), tqdm.tqdm(total=len(exs), disable=not progress)

    def sample_fn(batch, n, *, start):  # the key of a chunk is its position: a resume is exact
        return evaluate.sampled_rewards(
            handle, params, prompts=[tok.encode_prompt(e.prompt) for e in batch],
            metas=[e.meta for e in batch], prompt_texts=[e.prompt for e in batch],
            reward_fn=reward_fn, detokenize=tok.decode, key=jax.random.fold_in(key, start),
            cfg=cfg, sampling_kw=sampling_kw,
        )  # fmt: skip

    for start in range(0, len(exs), prompts_per_call):
        table = zero_variance.estimate_pass_rates(
            exs[start : start + prompts_per_call],
            sample_fn=functools.partial(sample_fn, start=start),
            num_samples=num_samples, policy_tag=tag, batch_size=prompts_per_call,
            success_threshold=s.advantage.success_threshold, existing=table,
            id_fn=lambda e: e.id,
        )  # fmt: skip
        if path:
            table.save(path)
        bar.update(len(exs[start : start + prompts_per_call]))
    bar.close()
    return table
