"""The offline pass rates of a run's training prompts (`espo.pass_rates`, experiments/pass_rates.py)
and the trainer's history seeded from them (`zve.pass_rate_table`).

Independent checks: a reward known before sampling (`testing.prompt_parity_reward`: every
prompt's pass rate is exactly 0 or 1) gives the table by hand; `evaluate.sampled_rewards` keeps
each prompt's rows (a reward that names its prompt); the seeded history's rates are the table's
counts plus the prior, by hand; a run given a table that marks prompts solved pre-filters them
from its first step.
"""

from __future__ import annotations

import pathlib

import jax
import numpy as np
import pytest

from espo import config as config_lib
from espo import evaluate, metrics, pass_rates, testing, trainer
from espo import model as model_lib
from espo import zero_variance as zv
from espo.data import sources
from espo.data import tokenizer as tokenizer_lib
from espo.testing import raises_invalid

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _config(**overrides):
    cfg = testing.load_script(ROOT / "configs" / "default.py").get_config("tiny")
    cfg.sft.steps = 0  # RL starts from the initialised policy: nothing to warm-start
    for key, value in overrides.items():
        section, field = key.split("__")
        cfg[section][field] = value
    return cfg


def _fitting_train_prompts(cfg):
    s = config_lib.Settings.from_config(cfg)
    tok = tokenizer_lib.load_tokenizer(s.hf_path)
    src = sources.make_sources(s.data)[0]
    exs = [src[i] for i in range(len(src))]
    return [e for e in exs if len(tok.encode_prompt(e.prompt)) <= s.max_prompt_length]


def test_estimate_by_hand_with_a_reward_known_before_sampling(tmp_path, monkeypatch):
    """Every prompt's rate is its prompt's parity; the first max_prompts fitting training
    prompts, keyed by example id, scored at advantage.success_threshold; written to `out` and
    resumed from it (a second call samples nothing: its sampler is never called)."""
    cfg = _config(reward__function="espo.testing:prompt_parity_reward", data__max_prompt_length=24)
    exs = _fitting_train_prompts(cfg)
    assert 6 < len(exs) < 64  # some prompts do not fit 24 tokens
    out = tmp_path / "rates.json"
    table = pass_rates.estimate(cfg, num_samples=3, max_prompts=6, out=out, prompts_per_call=4)
    want = {e.id: float(sum(map(ord, e.prompt)) % 2) for e in exs[:6]}
    assert dict(table.pass_rates) == want and 0 < sum(want.values()) < 6
    assert table.num_samples == 3 and table.success_threshold == 0.5
    assert table.policy_tag == "initialised with seed 0"
    assert zv.PassRateTable.load(out) == table
    monkeypatch.setattr(evaluate, "sampled_rewards", lambda *a, **k: pytest.fail("sampled"))
    again = pass_rates.estimate(cfg, num_samples=3, max_prompts=6, out=out, prompts_per_call=4)
    assert again == table
    with pytest.raises(FileExistsError, match="delete it or choose another --out"):
        pass_rates.estimate(cfg, num_samples=2, max_prompts=6, out=out)


def test_an_estimate_resumed_from_its_file_equals_one_uninterrupted(tmp_path):
    """Sampled rewards (the completion's length): 4 prompts then 8 resumed from the file give
    the table of 8 at once (a chunk's key is its position), and the rates are not all 0 or 1."""
    cfg = _config(reward__function="espo.testing:length_reward")
    out = tmp_path / "resumed.json"
    pass_rates.estimate(cfg, num_samples=4, max_prompts=4, out=out, prompts_per_call=4)
    resumed = pass_rates.estimate(cfg, num_samples=4, max_prompts=8, out=out, prompts_per_call=4)
    whole = pass_rates.estimate(cfg, num_samples=4, max_prompts=8, prompts_per_call=4)
    assert resumed == whole and len(whole.pass_rates) == 8
    assert any(0 < r < 1 for r in whole.pass_rates.values())


def test_estimate_errors_name_their_field():
    with raises_invalid("init_from", where="--config.model", kind=config_lib.ConfigError):
        pass_rates.estimate(_config(sft__steps=2), num_samples=2)  # the RL policy is the SFT's
    with raises_invalid("num_samples", where="estimate"):
        pass_rates.estimate(_config(), num_samples=0)
    with raises_invalid("max_prompts", where="estimate"):
        pass_rates.estimate(_config(), num_samples=2, max_prompts=-1)
    with raises_invalid("temperature", where="--config.rollout", kind=config_lib.ConfigError):
        pass_rates.estimate(_config(rollout__temperature=0.0), num_samples=2)
    with raises_invalid("max_prompt_length", where="--config.data", kind=config_lib.ConfigError):
        pass_rates.estimate(_config(data__max_prompt_length=1), num_samples=2)


def test_sampled_rewards_keeps_each_prompts_rows():
    """[P, k] rewards, row i from prompt i's completions: 5 prompts in calls of 2 (the last
    padded with copies that are dropped)."""
    cfg = model_lib.ModelConfig(
        vocab_size=320, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
        num_experts=2, top_k=1, moe_ffn_dim=16,
    )  # fmt: skip
    params = model_lib.init(cfg, jax.random.key(0))
    texts = [f"p{i}" for i in range(5)]
    prompts = [[1 + i] * (1 + i % 3) for i in range(5)]
    seen = []

    def reward_fn(prompt, completion, meta):
        seen.append((prompt, meta["i"]))
        return float(texts.index(prompt))

    ecfg = evaluate.EvalConfig(samples=3, temperature=1.0, max_new_tokens=4, batch_size=6)
    rewards = evaluate.sampled_rewards(
        cfg, params, prompts=prompts, metas=[{"i": i} for i in range(5)], prompt_texts=texts,
        reward_fn=reward_fn, detokenize=lambda ids: str(ids), key=jax.random.key(1), cfg=ecfg,
        sampling_kw=dict(stop_ids=(0,), pad_id=0),
    )  # fmt: skip
    np.testing.assert_array_equal(rewards, np.repeat(np.arange(5.0)[:, None], 3, axis=1))
    assert sorted(seen) == sorted((t, i) for i, t in enumerate(texts) for _ in range(3))
    with pytest.raises(ValueError, match="one entry per prompt"):
        evaluate.sampled_rewards(
            cfg, params, prompts=prompts, metas=[{}], prompt_texts=texts, reward_fn=reward_fn,
            detokenize=str, key=jax.random.key(1), cfg=ecfg, sampling_kw={},
        )  # fmt: skip


def _table(exs, rates, *, threshold=0.5, n=4):
    return zv.PassRateTable(
        policy_tag="warm", num_samples=n, success_threshold=threshold,
        pass_rates={e.id: r for e, r in zip(exs, rates, strict=True)},
    )  # fmt: skip


def test_the_trainer_seeds_its_history_from_the_table(tmp_path):
    """The history's rates: (rate x N + 0.5) / (N + 1) with the Beta(0.5, 0.5) prior; an unknown
    prompt is NaN; without a table the history is empty."""
    cfg = _config()
    exs = _fitting_train_prompts(cfg)[:3]
    path = tmp_path / "t.json"
    _table(exs, [0.0, 0.25, 1.0]).save(path)
    src = sources.make_sources(config_lib.Settings.from_config(cfg).data)[0]
    s = config_lib.Settings.from_config(_config(zve__pass_rate_table=str(path)))
    history = trainer._history(s, src)
    got = history.pass_rates([e.id for e in exs] + ["unknown"])
    np.testing.assert_allclose(got[:3], [0.5 / 5, 1.5 / 5, 4.5 / 5])
    assert np.isnan(got[3]) and history.success_threshold == 0.5
    assert trainer._history(config_lib.Settings.from_config(cfg), src).counts == {}


def test_a_bad_table_is_one_line_naming_the_key(tmp_path):
    cfg = _config()
    exs = _fitting_train_prompts(cfg)[:2]
    src = sources.make_sources(config_lib.Settings.from_config(cfg).data)[0]
    other = zv.PassRateTable(policy_tag="w", num_samples=2, pass_rates={"not-a-prompt": 0.5})
    (tmp_path / "junk.json").write_text("[1, 2]")
    cases = {
        "missing.json": None,
        "junk.json": None,
        "threshold.json": _table(exs, [0.5, 0.5], threshold=0.0),
        "other.json": other,
    }
    for name, table in cases.items():
        if table is not None:
            table.save(tmp_path / name)
        s = config_lib.Settings.from_config(_config(zve__pass_rate_table=str(tmp_path / name)))
        with raises_invalid("pass_rate_table", where="--config.zve", kind=config_lib.ConfigError):
            trainer._history(s, src)


@pytest.mark.slow
def test_a_run_given_the_table_prefilters_from_its_first_step(tmp_path):
    """A table that marks every training prompt but four solved: with zve.prefilter=drop the
    first step rejects more draws than the same run without it (whose rejections are the
    curriculum's and the length limit's: an online history starts empty)."""
    cfg = _config(train__steps=1)
    exs = _fitting_train_prompts(cfg)
    _table(exs, [0.5] * 4 + [1.0] * (len(exs) - 4), n=16).save(tmp_path / "t.json")
    rejected = {}
    for name, table in (("with", str(tmp_path / "t.json")), ("without", "")):
        trainer.train(_config(train__steps=1, zve__pass_rate_table=table), str(tmp_path / name))
        rows = metrics.read_jsonl(tmp_path / name / "metrics.jsonl")
        rejected[name] = [r["data/rejected"] for r in rows if "data/rejected" in r][-1]
    assert rejected["with"] > rejected["without"]
