"""The sampler: exact sequences with a fake model, real distributions, randomness, continuation.

Fakes (`espo.testing.CountingModel`): the default one is near-deterministic (exact sequences);
`SOFT` has a real distribution whose shape depends on the token (log-probs, entropies and their
positions can be told apart); `UNIFORM` draws every token with probability 1/8. Per-token
log-probs and entropies are checked against a recompute on the returned tokens: the fake's own
logits for fakes, `espo.train_step.token_logps` (the trainer's one home of log-probs) for the
tiny real model.
"""

import functools
import re
from unittest import mock

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from jax.sharding import PartitionSpec as P

from espo import errors, model, quant, sampler, scheduling, sharding, testing, train_step, types
from espo.testing import raises_invalid

EOS, PAD = 5, 0


@pytest.mark.slow
def test_fake_model_exact_sequences_eos_and_trace():
    prompts = np.array([[1, 2, 0], [4, 5, 6]])
    out = sampler.sample(
        testing.CountingModel(), None, prompts, np.array([2, 3]), key=jax.random.key(0),
        num_samples=2, max_new_tokens=5, stop_ids=(EOS,), pad_id=PAD,
        buckets=scheduling.LengthBuckets(prompt_buckets=(4,), generation_buckets=(8,)),
    )  # fmt: skip
    # Prompt 0 ends with 2 -> 3, 4, 5 (EOS). Prompt 1 ends with 6 -> 7, 0, 1, 2, 3 (budget 5).
    want = [[3, 4, 5, PAD, PAD, PAD, PAD, PAD]] * 2 + [[7, 0, 1, 2, 3, PAD, PAD, PAD]] * 2
    np.testing.assert_array_equal(out.tokens, want)
    np.testing.assert_array_equal(out.lengths, [3, 3, 5, 5])
    np.testing.assert_array_equal(out.mask, np.arange(8)[None] < np.array([3, 3, 5, 5])[:, None])
    np.testing.assert_allclose(out.logps[out.mask], 0.0, atol=1e-9)  # near-certain tokens
    assert (out.logps[~out.mask] == 0).all() and (out.entropies[~out.mask] == 0).all()
    # Left-padded prompts; the trace holds each position's own token % 3, -1 on padding.
    np.testing.assert_array_equal(out.prompt_tokens[0], [PAD, PAD, 1, 2])
    tokens, mask = out.training_inputs()
    want_ids = np.where(mask, np.asarray(tokens) % 3, -1)
    np.testing.assert_array_equal(out.router.expert_ids[:, 0, :, 0], want_ids)


@pytest.mark.slow
def test_a_row_stops_at_any_of_the_stop_ids():
    """Stop ids 3 and 6: prompt 0 (last token 1) reaches 3 first, prompt 1 (last 4) reaches 6
    first (a sampler checking only the first stop id runs it on), prompt 2 (last 6, a stop id
    in the prompt, which does not count) meets neither within the budget of 4: 7, 0, 1, 2."""
    prompts = np.array([[1, 0], [4, 0], [6, 0]])
    out = sampler.sample(
        testing.CountingModel(), None, prompts, np.array([1, 1, 1]), key=jax.random.key(0),
        num_samples=1, max_new_tokens=4, stop_ids=(3, 6), pad_id=PAD,
        buckets=scheduling.LengthBuckets(prompt_buckets=(4,), generation_buckets=(8,)),
    )  # fmt: skip
    want = [[2, 3] + [PAD] * 6, [5, 6] + [PAD] * 6, [7, 0, 1, 2] + [PAD] * 4]
    np.testing.assert_array_equal(out.tokens, want)
    np.testing.assert_array_equal(out.lengths, [2, 2, 4])
    np.testing.assert_array_equal(out.finished, [True, True, False])
    # The pad id may itself be a stop id (Qwen3's <|endoftext|>): lengths still delimit rows.
    same_pad = sampler.sample(
        testing.CountingModel(), None, prompts, np.array([1, 1, 1]), key=jax.random.key(0),
        num_samples=1, max_new_tokens=4, stop_ids=(3, 6), pad_id=3,
        buckets=scheduling.LengthBuckets(prompt_buckets=(4,), generation_buckets=(8,)),
    )  # fmt: skip
    np.testing.assert_array_equal(same_pad.lengths, [2, 2, 4])
    np.testing.assert_array_equal(same_pad.finished, [True, True, False])


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("stop_ids", (), "stop_ids"),
        ("stop_ids", 5, "stop_ids"),
        ("stop_ids", (1, 1), "stop_ids"),
        ("stop_ids", (1, -1), "stop_ids"),
        ("stop_ids", (1.0,), "stop_ids"),
        ("pad_id", -1, "pad_id"),
        ("max_new_tokens", 0, "max_new_tokens"),
        ("temperature", -0.5, "temperature"),
        ("top_p", 0.0, "top_p"),
        ("top_p", 1.5, "top_p"),
        ("top_k", -1, "top_k"),
    ],
)
def test_sampling_params_name_the_bad_field(field, value, message):
    good = dict(max_new_tokens=4, stop_ids=(1,), pad_id=0)
    with raises_invalid(message, where="SamplingParams"):
        sampler.SamplingParams(**(good | {field: value}))
    # A list of ids is stored as a tuple (hashable: it is a jit static of the sampler).
    assert sampler.SamplingParams(**(good | {"stop_ids": [2, 1]})).stop_ids == (2, 1)
    assert sampler.SamplingParams(**(good | {"max_new_tokens": 1})).max_new_tokens == 1
    assert sampler.SamplingParams(**(good | {"stop_ids": (0,), "top_p": 1})).stop_ids == (0,)
    assert type(sampler.SamplingParams(**(good | {"pad_id": np.int64(3)})).pad_id) is int


def test_left_pad_right_aligns_each_row_and_refuses_a_missing_length():
    # Row lengths 2, 0 (an empty row: all padding) and 1 of rows longer than that.
    out, mask = sampler.left_pad([[5, 3, 1], [2], [7, 6]], [2, 0, 1], width=3, pad_id=9)
    np.testing.assert_array_equal(out, [[9, 5, 3], [9, 9, 9], [9, 9, 7]])
    np.testing.assert_array_equal(mask, [[0, 1, 1], [0, 0, 0], [0, 0, 1]])
    assert out.dtype == np.int32 and mask.dtype == bool
    with pytest.raises(ValueError, match="zip"):
        sampler.left_pad([[5, 3], [2]], [2], width=3, pad_id=9)


def test_a_model_without_the_protocol_is_refused():
    valid = (
        "pass an espo.model.Model, a ModelConfig, or an object with num_layers, top_k, "
        "forward(params, tokens, *, attention_mask, cache) and init_cache(*, batch, max_length)"
    )
    with pytest.raises(
        TypeError, match=r"is not a SamplingModel \(missing \['num_layers'.*" + re.escape(valid)
    ):
        sampler.sample(
            object(), None, np.ones((1, 2), int), np.array([2]), key=jax.random.key(0),
            num_samples=1, max_new_tokens=4, stop_ids=(1,), pad_id=0,
        )  # fmt: skip


@pytest.mark.parametrize(
    ("num_samples", "lengths", "message"),
    [
        (0, [2, 3], "num_samples"),
        (2.0, [2, 3], "num_samples"),
        (1, [2, 0], "prompt_lengths must be >= 1, got min 0"),
    ],
)
def test_sample_names_a_bad_num_samples_or_an_empty_prompt(num_samples, lengths, message):
    with pytest.raises(ValueError) as error:
        sampler.sample(
            testing.CountingModel(), None, np.ones((2, 3), int), np.array(lengths),
            key=jax.random.key(0), num_samples=num_samples, max_new_tokens=4, stop_ids=(1,),
            pad_id=0,
        )  # fmt: skip
    got = error.value.field if isinstance(error.value, errors.InvalidValue) else str(error.value)
    assert got == message


@pytest.mark.slow
def test_fake_cache_has_the_real_layout_and_aux():
    """The fake's KV cache is laid out as `layers.init_cache` lays out a real one (a [B, N, S,
    Dh] buffer a layer) and holds each token id at its slot and row; its aux is a real ModelAux."""
    fake = testing.CountingModel(num_layers=2)
    real = model.ModelConfig.tiny(
        num_layers=2, num_heads=1, num_kv_heads=1, head_dim=testing.CountingModel.HEAD_DIM
    )
    chex.assert_trees_all_equal_shapes_and_dtypes(
        fake.init_cache(batch=3, max_length=5), model.init_cache(real, batch=3, max_length=5)
    )
    tokens = jnp.array([[1, 2], [3, 4], [5, 6]])
    out = fake.forward(None, tokens, cache=fake.init_cache(batch=3, max_length=5))
    out = fake.forward(None, tokens[:, :1] + 10, cache=out.cache)
    want = np.array([[1, 2, 11, 0, 0], [3, 4, 13, 0, 0], [5, 6, 15, 0, 0]], np.float32)
    np.testing.assert_array_equal(out.cache.k[1][:, 0, :, 0], want)  # [B, S] of layer 1
    np.testing.assert_array_equal(out.cache.kv_positions[:, 3:], -1)
    assert int(out.cache.index) == 3
    assert isinstance(out.aux, model.ModelAux) and out.aux.expert_load.shape == (2, 3)
    chex.assert_shape(out.router.expert_ids, (3, 2, 1, 1))  # [B, L, T, K]


SOFT = testing.CountingModel(sharpness=1.0, spread=1.0)  # p(peak) 0.28 / 0.51 / 0.74
UNIFORM = testing.CountingModel(sharpness=0.0)
V = 8  # the fakes' vocabulary


def _recompute(logits_fn, out: sampler.SampleOutput, temperature: float):
    """(log-prob of each returned token, full-vocabulary entropy) [R, Tg] from one forward.

    logp_t = log_softmax(logits_{t-1} / temperature)[token_t] over the prompt + completion the
    sampler returned (temperature 0 = greedy: temperature 1), in float32.
    """
    tokens, mask = out.training_inputs()
    logits = logits_fn(tokens, mask).astype(jnp.float32)  # [R, Tp + Tg, V]
    Tp = out.prompt_tokens.shape[1]
    scale = 1.0 if temperature == 0 else temperature
    logp = jax.nn.log_softmax(logits[:, Tp - 1 : -1] / scale, axis=-1)  # predicts completion t
    token_logp = jnp.take_along_axis(logp, out.tokens[..., None], axis=-1)[..., 0]  # [R, Tg]
    return token_logp, -jnp.sum(jnp.exp(logp) * logp, axis=-1), logp


def _fake_logits(fake):
    return lambda tokens, mask: fake.logits(tokens)


def _assert_matches_recompute(out, logits_fn, temperature, *, atol=1e-5):
    token_logp, entropy, logp = _recompute(logits_fn, out, temperature)
    m = np.asarray(out.mask)
    np.testing.assert_allclose(out.logps[m], token_logp[m], atol=atol, rtol=atol)
    np.testing.assert_allclose(out.entropies[m], entropy[m], atol=atol, rtol=atol)
    assert (np.asarray(out.logps)[~m] == 0).all() and (np.asarray(out.entropies)[~m] == 0).all()
    assert (np.asarray(out.entropies)[m] >= 0).all()
    return logp


def _sample_fake(fake, *, key=0, num_samples=4, max_new_tokens=16, gen_bucket=16, **kw):
    prompts = np.array([[1, 2, 0], [4, 6, 5], [0, 3, 3]])
    args = dict(
        key=jax.random.key(key), num_samples=num_samples, max_new_tokens=max_new_tokens,
        stop_ids=(V - 1,), pad_id=PAD,
        buckets=scheduling.LengthBuckets(prompt_buckets=(4,), generation_buckets=(gen_bucket,)),
    )  # fmt: skip
    return sampler.sample(fake, None, prompts, np.array([2, 3, 3]), **(args | kw))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k"),
    [(1.0, 1.0, 0), (0.7, 0.8, 0), (1.5, 1.0, 3), (1.3, 0.9, 4), (0.0, 1.0, 0)],
)
def test_soft_fake_logps_entropies_and_trace_equal_a_recompute(temperature, top_p, top_k):
    """Per-token log-probs of the tempered, *untruncated* distribution, entropies >= 0."""
    out = _sample_fake(SOFT, temperature=temperature, top_p=top_p, top_k=top_k)
    logp = _assert_matches_recompute(out, _fake_logits(SOFT), temperature)
    m = np.asarray(out.mask)
    # A real distribution: entropies vary with the token and are never the log-probs.
    assert len(np.unique(np.round(np.asarray(out.entropies)[m], 4))) == 3
    assert (np.asarray(out.logps)[m] < -1e-3).all() and (np.asarray(out.entropies)[m] > 0.3).all()
    # Sampled tokens lie in the truncated support (rank among strictly larger log-probs).
    token_logp = np.asarray(out.logps)[..., None]
    rank = np.sum(np.asarray(logp) > token_logp + 1e-6, axis=-1)
    if temperature == 0 or top_k == 1:
        assert (rank[m] == 0).all()
    elif top_k:
        assert (rank[m] < top_k).all()
    # The trace holds each position's own token % 3, -1 on padding.
    tokens, tmask = out.training_inputs()
    want_ids = np.where(tmask, np.asarray(tokens) % 3, -1)
    np.testing.assert_array_equal(out.router.expert_ids[:, 0, :, 0], want_ids)
    if temperature:  # stochastic: some rows of a prompt differ, and lengths vary
        assert len({tuple(r) for r in np.asarray(out.tokens)}) > 6


@pytest.mark.slow
def test_randomness_across_rows_steps_and_keys():
    """Uniform logits over 8 tokens, 16 rows x 32 steps, EOS never sampled.

    Every (row, step) must be a fresh draw: a key reused at every decode step makes each row
    repeat one token; one uniform shared by all rows makes the rows identical; the same key
    must reproduce the draw bit for bit and another key must draw differently.
    """
    run = functools.partial(
        _sample_fake, UNIFORM, num_samples=8, max_new_tokens=32, gen_bucket=32, stop_ids=(99,)
    )
    out = run()
    tokens = np.asarray(out.tokens)  # [24, 32]
    assert out.mask.all()
    np.testing.assert_allclose(out.logps, -np.log(V), atol=1e-6)
    np.testing.assert_allclose(out.entropies, np.log(V), atol=1e-6)
    # Frequencies: chi-square with 7 degrees of freedom (P(> 30) ~ 1e-4 when uniform).
    counts = np.bincount(tokens.ravel(), minlength=V)
    expected = tokens.size / V
    assert np.sum((counts - expected) ** 2 / expected) < 30, counts
    # Each row moves (>= 4 distinct tokens of 8 in 32 draws), each step varies across rows,
    # consecutive draws are independent (~1/8 equal), and no two rows are equal.
    assert min(len(set(r)) for r in tokens) >= 4
    assert min(len(set(c)) for c in tokens.T) >= 3
    assert np.mean(tokens[:, 1:] == tokens[:, :-1]) < 0.25
    assert len({tuple(r) for r in tokens}) == len(tokens)
    again = run()
    np.testing.assert_array_equal(again.tokens, tokens)
    np.testing.assert_array_equal(again.logps, out.logps)
    other = run(key=7)
    assert np.mean(np.asarray(other.tokens) == tokens) < 0.25


def _settings(*, temperature, stop_ids, top_p=1.0, top_k=0):
    return sampler.SamplingParams(
        max_new_tokens=16, temperature=temperature, top_p=top_p, top_k=top_k, stop_ids=stop_ids,
        pad_id=PAD,
    )  # fmt: skip


def _continue(fake, prompts, mask, key, *, budgets, temperature, stop_id):
    """One pass with budgets[-1], and the same key run in chunks continuing from a Prefix."""
    run = functools.partial(
        sampler.sample_chunk, fake, None, jnp.asarray(prompts), jnp.asarray(mask), key,
        num_samples=1, gen_len=16,
        sampling=_settings(temperature=temperature, stop_ids=(stop_id,)),
    )  # fmt: skip
    chunks = [run(jnp.asarray(budgets[0]))]
    for b in budgets[1:]:
        chunks.append(run(jnp.asarray(b), _prefix_of(chunks[-1])))
    return run(jnp.asarray(budgets[-1])), chunks


def _prefix_of(out: sampler.SampleOutput) -> sampler.Prefix:
    """The whole of a chunk's output as the prefix its rows continue from."""
    return sampler.Prefix(
        tokens=out.tokens, lengths=out.lengths, logps=out.logps, entropies=out.entropies
    )


@pytest.mark.slow
def test_soft_fake_continuing_greedy_in_chunks_equals_one_pass():
    # Last prompt tokens 3, 2, 0 reach EOS (7) after 4, 5, 7 tokens; budget 6 cuts the last.
    # Chunks of 3 then 6: every row is unfinished after the first (as the rollout continues).
    prompts, mask = sampler.left_pad([[5, 3], [2], [1, 0]], [2, 1, 2], width=4, pad_id=PAD)
    whole, chunks = _continue(
        SOFT, prompts, mask, jax.random.key(0), budgets=(3, 6), temperature=0.0, stop_id=V - 1
    )
    np.testing.assert_array_equal(whole.lengths, [4, 5, 6])
    np.testing.assert_array_equal(whole.finished, [True, True, False])
    rest = chunks[-1]
    # Every array equal (ints exactly, floats to 1e-6), only the decode step count differs.
    chex.assert_trees_all_close(rest.replace(num_steps=whole.num_steps), whole, atol=1e-6)
    _assert_matches_recompute(rest, _fake_logits(SOFT), 0.0)
    assert (np.asarray(rest.entropies)[np.asarray(rest.mask)] > 0.5).all()
    # Ragged prefixes (1, 3, 2 tokens of the one pass): rows reach the budget 3 at different
    # steps, and one at its budget must not take another token while the others still run.
    prompts, mask = sampler.left_pad([[1, 0]] * 3, [2] * 3, width=4, pad_id=PAD)
    whole, _ = _continue(
        SOFT, prompts, mask, jax.random.key(0), budgets=(3,), temperature=0.0, stop_id=V - 1
    )
    lengths = jnp.array([1, 3, 2])
    keep = jnp.arange(16)[None] < lengths[:, None]
    prefix = sampler.Prefix(
        tokens=jnp.where(keep, whole.tokens, PAD), lengths=lengths,
        logps=jnp.where(keep, whole.logps, 0.0), entropies=jnp.where(keep, whole.entropies, 0.0),
    )  # fmt: skip
    ragged = sampler.sample_chunk(
        SOFT, None, jnp.asarray(prompts), jnp.asarray(mask), jax.random.key(0), jnp.asarray(3),
        prefix, num_samples=1, gen_len=16, sampling=_settings(temperature=0.0, stop_ids=(V - 1,)),
    )  # fmt: skip
    np.testing.assert_array_equal(ragged.lengths, [3, 3, 3])
    np.testing.assert_array_equal(ragged.tokens, whole.tokens)
    np.testing.assert_allclose(ragged.entropies, whole.entropies, atol=1e-6)


@pytest.mark.slow
def test_soft_fake_sampled_continuation_keeps_prefix_logps_and_entropies():
    """Sampled chunks of 3, 7 then 12 tokens: each continuation keeps its prefix's log-probs
    and entropies as they were and its new ones equal the recompute (EOS never sampled)."""
    prompts, mask = sampler.left_pad([[5, 3], [2], [1, 0]], [2, 1, 2], width=4, pad_id=PAD)
    _, chunks = _continue(
        SOFT, prompts, mask, jax.random.key(3), budgets=(3, 7, 12), temperature=1.0, stop_id=99
    )
    for before, after in zip(chunks[:-1], chunks[1:], strict=True):
        n = int(before.lengths[0])
        np.testing.assert_array_equal(after.tokens[:, :n], before.tokens[:, :n])
        np.testing.assert_array_equal(after.logps[:, :n], before.logps[:, :n])
        np.testing.assert_array_equal(after.entropies[:, :n], before.entropies[:, :n])
        _assert_matches_recompute(after, _fake_logits(SOFT), 1.0)
    np.testing.assert_array_equal(chunks[-1].lengths, 12)


def test_a_continuation_keeps_a_prefix_it_would_not_have_sampled():
    """A prefix drawn with another key: the continuation starts from it, not from its own
    draws (the same key would redraw a prefix of its own and hide a dropped prefix)."""
    prompts, mask = sampler.left_pad([[5, 3], [2], [1, 0]], [2, 1, 2], width=4, pad_id=PAD)
    run = functools.partial(
        sampler.sample_chunk, SOFT, None, jnp.asarray(prompts), jnp.asarray(mask),
        num_samples=1, gen_len=16, sampling=_settings(temperature=1.0, stop_ids=(99,)),
    )  # fmt: skip
    first = run(jax.random.key(4), jnp.asarray(3))
    prefix = _prefix_of(first)
    own = run(jax.random.key(3), jnp.asarray(7))
    assert (np.asarray(own.tokens[:, :3]) != np.asarray(first.tokens[:, :3])).any()
    cont = run(jax.random.key(3), jnp.asarray(7), prefix)
    np.testing.assert_array_equal(cont.lengths, 7)
    np.testing.assert_array_equal(cont.tokens[:, :3], first.tokens[:, :3])
    np.testing.assert_array_equal(cont.logps[:, :3], first.logps[:, :3])
    np.testing.assert_array_equal(cont.entropies[:, :3], first.entropies[:, :3])
    _assert_matches_recompute(cont, _fake_logits(SOFT), 1.0)
    with pytest.raises(ValueError, match=r"a prefix \(continuation\) needs num_samples=1, got 2"):
        run(jax.random.key(3), jnp.asarray(7), prefix, num_samples=2)


CFG = model.ModelConfig.tiny(vocab_size=64)
MODEL = model.Model(CFG)


@pytest.fixture(scope="module")
def params():
    return MODEL.init(jax.random.key(0))


PROMPTS = np.random.RandomState(0).randint(2, 64, (3, 9))
LENGTHS = np.array([9, 4, 6])


def _sample(params, **kw):
    args = dict(key=jax.random.key(1), num_samples=2, max_new_tokens=12, stop_ids=(1,), pad_id=0)
    return sampler.sample(MODEL, params, PROMPTS, LENGTHS, **(args | kw))


_forward = jax.jit(MODEL.forward, static_argnames="routing_mode")
_token_logps = jax.jit(train_step.token_logps, static_argnames=("model_cfg", "temperature"))


def _next_token_logits(params, out):
    """Logits [R, Tg, V] of a full forward at the positions that predict completion token t."""
    tokens, mask = out.training_inputs()
    Tp = out.prompt_tokens.shape[1]
    return _forward(params, tokens, attention_mask=mask).logits[:, Tp - 1 : -1]


# Tempered and truncated both ways; the top-k test samples with it too (one program for both):
# its nucleus alone keeps most of the random model's 64 tokens, top_k=3 three.
TRUNCATED = dict(temperature=0.7, top_p=0.9, top_k=3)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k"), [(1.0, 1.0, 0), tuple(TRUNCATED.values())]
)
def test_logps_entropies_and_trace_equal_the_full_forward(params, temperature, top_p, top_k):
    out = _sample(params, temperature=temperature, top_p=top_p, top_k=top_k)
    tokens, mask = out.training_inputs()
    # The trainer's log-probs (one forward, aligned with tokens) on the sampled completions.
    logps, entropies, _ = _token_logps(CFG, params, tokens, mask, temperature=temperature)
    Tp, m = out.prompt_tokens.shape[1], np.asarray(out.mask)
    got = train_step.completion(logps, prompt_length=Tp)
    got_entropies = train_step.completion(entropies, prompt_length=Tp)
    np.testing.assert_allclose(out.logps[m], got[m], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(out.entropies[m], got_entropies[m], atol=1e-4, rtol=1e-4)
    assert (np.asarray(out.logps)[~m] == 0).all() and (np.asarray(out.entropies)[~m] == 0).all()
    assert (np.asarray(out.entropies)[m] > 0).all() and (np.asarray(out.logps)[m] < 0).all()
    full = _forward(params, tokens, attention_mask=mask)
    real = np.asarray(mask)[:, None, :, None]
    np.testing.assert_array_equal(
        np.where(real, out.router.expert_ids, -1), np.where(real, full.router.expert_ids, -1)
    )
    # Replaying the rollout's trace reproduces the sampled log-probs.
    tokens, mask = out.training_inputs()
    replay = _forward(
        params, tokens, attention_mask=mask, routing=out.router,
        routing_mode=model.RoutingMode.REPLAY_IDS,
    )  # fmt: skip
    np.testing.assert_allclose(replay.logits[mask], full.logits[mask], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("num_experts", "dtype"),
    [(1, np.int8), (128, np.int8), (129, np.int16), (32768, np.int16), (32769, np.int32)],
)
def test_the_trace_id_type_holds_the_largest_id_and_minus_one(num_experts, dtype):
    got = types.expert_id_dtype(num_experts)
    assert got == dtype
    assert np.array([num_experts - 1, -1], got).tolist() == [num_experts - 1, -1]


@pytest.mark.slow
def test_an_ids_only_trace_decodes_the_same_and_is_compact(params):
    """trace_weights=False (the rollout's) records the same ids in the model's smallest id type
    and samples the same rows; the weights, when recorded, are the full forward's."""
    both, ids_only = _sample(params), _sample(params, trace_weights=False)
    assert ids_only.router.expert_weights is None
    assert both.router.expert_ids.dtype == ids_only.router.expert_ids.dtype == np.int8
    chex.assert_trees_all_equal(ids_only.replace(router=None), both.replace(router=None))
    np.testing.assert_array_equal(ids_only.router.expert_ids, both.router.expert_ids)
    tokens, mask = both.training_inputs()
    full = _forward(params, tokens, attention_mask=mask)
    real = np.asarray(mask)[:, None, :, None]
    np.testing.assert_allclose(
        np.where(real, both.router.expert_weights, 0),
        np.where(real, full.router.expert_weights, 0), atol=1e-5,
    )  # fmt: skip
    # An ids-only trace replays ids (the trainer's mode), not the weights it does not hold.
    replay = functools.partial(
        _forward, params, tokens, attention_mask=mask, routing=ids_only.router
    )
    ids = replay(routing_mode=model.RoutingMode.REPLAY_IDS)
    np.testing.assert_allclose(ids.logits[mask], full.logits[mask], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="expert_weights"):
        replay(routing_mode=model.RoutingMode.REPLAY_IDS_AND_WEIGHTS)


@pytest.mark.slow
def test_greedy_is_argmax_of_the_full_forward(params):
    out = _sample(params, temperature=0.0)
    logits = _next_token_logits(params, out)
    np.testing.assert_array_equal(out.tokens[out.mask], jnp.argmax(logits, -1)[out.mask])
    # The G samples of one prompt are identical under greedy decoding.
    np.testing.assert_array_equal(out.tokens[0::2], out.tokens[1::2])
    # top_k=1 and a tiny nucleus are greedy too.
    np.testing.assert_array_equal(_sample(params, top_k=1).tokens, out.tokens)
    np.testing.assert_array_equal(_sample(params, top_p=1e-6).tokens, out.tokens)


@pytest.mark.slow
def test_seed_reproducibility(params):
    a, b = _sample(params), _sample(params)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    c = _sample(params, key=jax.random.key(7))
    assert (np.asarray(a.tokens) != np.asarray(c.tokens)).any()


@pytest.mark.slow
def test_top_k_restricts_the_support(params):
    out = _sample(params, **TRUNCATED, max_new_tokens=8)
    logits = _next_token_logits(params, out)
    rank = jnp.sum(logits > jnp.take_along_axis(logits, out.tokens[..., None], -1), axis=-1)
    assert int(jnp.max(jnp.where(out.mask, rank, 0))) < 3


@pytest.mark.slow
def test_fp8_params_sample_transparently(params):
    qparams = jax.jit(quant.quantize_fp8)(params)  # op by op: ~30 small programs
    out = _sample(qparams, temperature=0.0)
    assert out.tokens.shape == (6, 16) and int(out.lengths.max()) <= 12


@pytest.mark.slow
def test_decode_loop_reads_the_model_decode_params_layout(params):
    # `Model.decode_params` splits the scanned [L, ...] weights per layer (read in place by the
    # decode loop, which then runs no loop over the layers), and the sampler
    # passes that layout to the model: the samples are the scanned layout's, bit for bit.
    layouts = []
    real = model.Model.decode_params

    def record(self, p):
        layouts.append(real(self, p))
        return layouts[-1]

    with mock.patch.object(model.Model, "decode_params", record):
        out = _sample(params)
    assert layouts and "blocks_0_layer_1" in layouts[0]
    with mock.patch.object(model.Model, "decode_params", lambda self, p: p):
        stacked = _sample(params)
    chex.assert_trees_all_equal(out, stacked)


@pytest.mark.slow
def test_buckets_bound_compiles_and_budget(params):
    _sample(params, max_new_tokens=12)
    before = sampler.compile_count()
    # Another prompt length and budget inside the same buckets: no new compile.
    out = sampler.sample(
        MODEL, params, PROMPTS[:, :7], np.array([7, 3, 5]), key=jax.random.key(2),
        num_samples=2, max_new_tokens=10, stop_ids=(1,), pad_id=0,
    )  # fmt: skip
    assert sampler.compile_count() == before
    # The same call through a bare ModelConfig is the same Model (hashed by value): no compile.
    sampler.sample(
        CFG, params, PROMPTS[:, :7], np.array([7, 3, 5]), key=jax.random.key(2),
        num_samples=2, max_new_tokens=10, stop_ids=(1,), pad_id=0,
    )  # fmt: skip
    assert sampler.compile_count() == before
    # Another stop set is another compiled function, counted once.
    _sample(params, stop_ids=(1, 2))
    _sample(params, stop_ids=(1, 2), key=jax.random.key(5))
    assert sampler.compile_count() == before + 1
    assert out.tokens.shape == (6, 16) and int(out.lengths.max()) <= 10
    # The count only grows: after jax.clear_caches() the next call compiles again, counted as 1
    # more (a jit's cache size would now read 1, and reads 0 once jax.jit's global LRU is full).
    before = sampler.compile_count()
    jax.clear_caches()
    _sample(params, stop_ids=(1, 2))
    assert sampler.compile_count() == before + 1
    with pytest.raises(
        ValueError, match=r"prompt length 40 exceeds the largest bucket 32 of \(16, 32\)"
    ):
        sampler.sample(
            CFG, params, np.ones((1, 40), int), np.array([40]), key=jax.random.key(0),
            num_samples=1, max_new_tokens=4, stop_ids=(1,), pad_id=0,
            buckets=scheduling.LengthBuckets(prompt_buckets=(16, 32), generation_buckets=(16,)),
        )  # fmt: skip


@pytest.mark.slow
def test_continuing_from_a_prefix_equals_one_pass(params):
    """Budget 4, then continue the unfinished rows from their prefixes: same as one pass."""
    prompts, mask = sampler.left_pad(PROMPTS, LENGTHS, width=16, pad_id=0)
    run = functools.partial(
        sampler.sample_chunk, MODEL, params, jnp.asarray(prompts), jnp.asarray(mask),
        jax.random.key(0), num_samples=1, gen_len=16,
        sampling=sampler.SamplingParams(
            max_new_tokens=12, temperature=0.0, stop_ids=(1,), pad_id=0
        ),
    )  # fmt: skip
    whole = run(jnp.asarray(12))
    first = run(jnp.asarray(4))
    assert int(first.num_steps) <= 4 and (first.lengths <= 4).all()
    prefix = sampler.Prefix(
        tokens=first.tokens, lengths=first.lengths, logps=first.logps, entropies=first.entropies
    )
    rest = run(jnp.asarray(12), prefix)
    np.testing.assert_array_equal(rest.tokens, whole.tokens)
    np.testing.assert_array_equal(rest.router.expert_ids, whole.router.expert_ids)
    # Every array (gate weights included) within the module tolerance of a cached decode.
    chex.assert_trees_all_close(rest.replace(num_steps=whole.num_steps), whole, atol=1e-4)


@pytest.mark.slow
def test_several_decode_steps_per_check_change_no_sample(params):
    """Rows stop early (stop id 1) and at a budget (10) that is no multiple of the steps per
    check; the steps past the last live row write nothing. Also through a continuation prefix,
    and 6 steps per check on a 16-slot buffer (taken down to 2: a 6th step would pass the
    cache's last slot): greedy there, the programs of one step per check are then those of
    test_continuing_from_a_prefix_equals_one_pass (the first part samples)."""
    one = _sample(params, max_new_tokens=10)
    assert int(one.num_steps) % 4 != 0  # the check lands between two multiples of 4
    four = _sample(params, max_new_tokens=10, steps_per_check=4)
    chex.assert_trees_all_equal(four.replace(num_steps=one.num_steps), one)
    assert int(four.num_steps) == 4 * -(-int(one.num_steps) // 4)
    prompts, mask = sampler.left_pad(PROMPTS, LENGTHS, width=16, pad_id=0)
    run = functools.partial(
        sampler.sample_chunk, MODEL, params, jnp.asarray(prompts), jnp.asarray(mask),
        jax.random.key(0), num_samples=1, gen_len=16,
        sampling=_settings(temperature=0.0, stop_ids=(1,)),
    )  # fmt: skip
    first = run(jnp.asarray(16))
    assert int(first.num_steps) == 16  # a row runs to the whole buffer
    got = run(jnp.asarray(16), steps_per_check=6)
    chex.assert_trees_all_equal(got, first)  # 16 steps, not 18: 2 per check
    prefix = sampler.Prefix(
        tokens=first.tokens, lengths=jnp.minimum(first.lengths, 3), logps=first.logps,
        entropies=first.entropies,
    )  # fmt: skip
    want = run(jnp.asarray(12), prefix)
    got = run(jnp.asarray(12), prefix, steps_per_check=4)
    chex.assert_trees_all_equal(got.replace(num_steps=want.num_steps), want)
    assert int(got.num_steps) % 4 == 0


def test_the_decode_loop_keeps_every_row_array_split_over_the_batch_axes(params):
    # Layout, not values (a missing constraint changes no number): traced on an abstract
    # 2-way data mesh, every carried array with a rows axis (R = 3 prompts x 2 samples = 6,
    # no other dimension is 6) enters and leaves the decode loop constrained to rows on the
    # batch axes, at its rows axis 0.
    R, batch = 6, sharding.BATCH_AXES
    run = functools.partial(
        sampler.sample_chunk, MODEL, params, num_samples=2, gen_len=8,
        sampling=_settings(temperature=1.0, stop_ids=(1,)),
    )  # fmt: skip
    prompts, mask = sampler.left_pad(PROMPTS.tolist(), LENGTHS.tolist(), width=9, pad_id=0)
    args = (prompts, mask, jax.random.key(0), jnp.asarray(8))  # concrete: made off the mesh
    with jax.sharding.use_abstract_mesh(sharding.abstract_mesh((2, 1, 1))):
        jaxpr = jax.make_jaxpr(run)(*args).jaxpr
    loops = [(e, at) for e, at in testing.jaxpr_equations(jaxpr) if e.primitive.name == "while"]
    carried = lambda loop_at: len(loop_at[0].params["body_jaxpr"].jaxpr.outvars)
    loop, parent = max(loops, key=carried)  # the decode loop carries the most arrays
    body = loop.params["body_jaxpr"].jaxpr
    carry_in = loop.invars[loop.params["cond_nconsts"] + loop.params["body_nconsts"] :]
    for where, holder, carry in (("into", parent, carry_in), ("out of", body, body.outvars)):
        made_by = {id(v): e for e in holder.eqns for v in e.outvars}
        rows = [v for v in carry if R in v.aval.shape]
        # Each layer's cache k and v; positions, logits, tokens, logps, entropies, done,
        # lengths, expert ids, weights.
        assert len(rows) == 2 * CFG.num_layers + 9, (where, [v.aval.shape for v in rows])
        for v in rows:
            e = made_by.get(id(v))
            assert e is not None and e.primitive.name == "sharding_constraint", (where, v.aval)
            axis = v.aval.shape.index(R)
            assert e.params["sharding"].spec == P(*[None] * axis, batch), (where, v.aval)


class ChooseTokensTest(chex.TestCase):
    """The decode step alone, jitted and not."""

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(
        ("untruncated", 0, 1.0, [0, 1, 2, 3]),
        ("top_k", 2, 1.0, [0, 1]),
        # Nucleus: the smallest set of most likely tokens with mass >= top_p. Masses before
        # each token are 0, .4, .7, .9: top_p .75 keeps 3 tokens, .65 keeps 2 (not 1, not 3).
        ("top_p", 0, 0.75, [0, 1, 2]),
        ("top_p_two", 0, 0.65, [0, 1]),
        ("top_p_one", 0, 0.35, [0]),
        # top-p applies to the top-k renormalised distribution (as vLLM): .4/.9, .3/.9, .2/.9;
        # masses before are 0, .44, .78, so top_p .75 keeps 2 (3 against the raw mass).
        ("top_k_then_top_p", 3, 0.75, [0, 1]),
    )
    def test_samples_the_truncated_distribution(self, top_k, top_p, kept):
        # p = (0.4, 0.3, 0.2, 0.1) at temperature 2 (logits doubled).
        probs = np.array([0.4, 0.3, 0.2, 0.1])
        logits = jnp.tile(jnp.log(jnp.asarray(probs)) * 2.0, (40_000, 1))
        choose = functools.partial(sampler.choose_tokens, temperature=2.0, top_p=top_p, top_k=top_k)
        tokens, logps, entropies = self.variant(choose)(logits, jax.random.key(3))
        want = np.zeros(4)
        want[kept] = probs[kept] / probs[kept].sum()
        freq = np.bincount(np.asarray(tokens), minlength=4) / len(tokens)
        np.testing.assert_allclose(freq, want, atol=0.01)  # ~4 standard errors
        # logps / entropies are those of the untruncated tempered distribution.
        np.testing.assert_allclose(logps, np.log(probs)[np.asarray(tokens)], rtol=1e-5)
        np.testing.assert_allclose(entropies, -np.sum(probs * np.log(probs)), rtol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(("greedy", 0.0), ("sampled", 0.7))
    def test_each_row_gets_its_own_logp_and_entropy(self, temperature):
        # Rows with different distributions (a tiled batch would hide a row mix-up).
        logits = jax.random.normal(jax.random.key(2), (6, 5)) * 3.0
        choose = functools.partial(
            sampler.choose_tokens, temperature=temperature, top_p=1.0, top_k=0
        )
        tokens, logps, entropies = self.variant(choose)(logits, jax.random.key(8))
        logp = jax.nn.log_softmax(logits / (temperature or 1.0), axis=-1)  # [6, 5]
        rows = np.arange(6)
        np.testing.assert_allclose(logps, np.asarray(logp)[rows, np.asarray(tokens)], rtol=1e-5)
        np.testing.assert_allclose(entropies, -(np.exp(logp) * logp).sum(-1), rtol=1e-5)
        assert len(set(np.asarray(entropies).round(4))) == 6
        if temperature == 0:
            np.testing.assert_array_equal(tokens, np.argmax(logits, axis=-1))

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(("half", 0.5, [0]), ("three_quarters", 0.75, [0, 1]))
    def test_a_nucleus_whose_mass_equals_top_p_stops_there(self, top_p, kept):
        # p = (1/2, 1/4, 1/8, 1/8), exact in float32: masses before each token are 0, 1/2, 3/4,
        # 7/8. The nucleus is the smallest set with mass >= top_p, so a mass of exactly top_p
        # ends it: top_p 1/2 keeps token 0 alone, 3/4 tokens 0 and 1 (`<=` would take one more).
        probs = np.array([0.5, 0.25, 0.125, 0.125])
        logits = jnp.tile(jnp.log(jnp.asarray(probs, jnp.float32)), (20_000, 1))
        choose = functools.partial(sampler.choose_tokens, temperature=1.0, top_p=top_p, top_k=0)
        tokens = np.asarray(self.variant(choose)(logits, jax.random.key(5))[0])
        assert set(np.unique(tokens)) == set(kept)
        want = probs[kept] / probs[kept].sum()
        np.testing.assert_allclose(np.bincount(tokens)[kept] / len(tokens), want, atol=0.015)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(("u_zero", 0.0, 1), ("u_one", 1.0, 2))
    def test_inverse_cdf_ends_land_on_kept_tokens(self, u, want):
        # p = (.1, .4, .3, .2), top_k 2 keeps tokens 1 and 2; cdf = (0, .4, .7, .7). u = 0 must
        # skip the zero-mass token 0 (first cdf > u); u = total mass (float rounding of
        # u * cdf[-1]) must not run past the last kept token to index 4 / token 3.
        logits = jnp.log(jnp.array([[0.1, 0.4, 0.3, 0.2]] * 3))
        fixed = lambda key, shape, *a, **k: jnp.full(shape, u, jnp.float32)
        choose = functools.partial(sampler.choose_tokens, temperature=1.0, top_p=1.0, top_k=2)
        with mock.patch.object(jax.random, "uniform", fixed):
            tokens, logps, _ = self.variant(choose)(logits, jax.random.key(0))
        np.testing.assert_array_equal(tokens, [want] * 3)
        chex.assert_tree_all_finite(logps)

    @chex.variants(with_jit=True, without_jit=True)
    def test_rows_draw_independently_and_greedy_is_argmax(self):
        logits = jnp.zeros((256, 8))
        choose = functools.partial(sampler.choose_tokens, temperature=1.0, top_p=1.0, top_k=0)
        tokens, _, _ = self.variant(choose)(logits, jax.random.key(0))
        counts = np.bincount(np.asarray(tokens), minlength=8)
        assert counts.min() >= 16, counts  # ~32 each; one draw shared by all rows: one bin
        greedy = functools.partial(sampler.choose_tokens, temperature=0.0, top_p=1.0, top_k=0)
        soft = jnp.log(jnp.array([[0.2, 0.5, 0.3], [0.6, 0.1, 0.3]]))
        tokens, logps, entropies = self.variant(greedy)(soft * 3.0, jax.random.key(0))
        np.testing.assert_array_equal(tokens, [1, 0])
        # Greedy reports the untempered (temperature 1) distribution of the logits it is given.
        want = jax.nn.log_softmax(soft * 3.0)
        np.testing.assert_allclose(logps, [want[0, 1], want[1, 0]], rtol=1e-6)
        np.testing.assert_allclose(entropies, -jnp.sum(jnp.exp(want) * want, -1), rtol=1e-6)
