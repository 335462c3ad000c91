"""The sampler: exact sequences with a fake model, and consistency with the full forward."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from espo import model, quant, sampler, scheduling, testing

EOS, PAD = 5, 0


def test_fake_model_exact_sequences_eos_and_trace():
    prompts = np.array([[1, 2, 0], [4, 5, 6]])
    out = sampler.sample(
        testing.CountingModel(), None, prompts, np.array([2, 3]), key=jax.random.key(0),
        num_samples=2, max_new_tokens=5, eos_id=EOS, pad_id=PAD,
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


CFG = model.ModelConfig.tiny(vocab_size=64)


@pytest.fixture(scope="module")
def params():
    return model.init(CFG, jax.random.key(0))


PROMPTS = np.random.RandomState(0).randint(2, 64, (3, 9))
LENGTHS = np.array([9, 4, 6])


def _sample(params, **kw):
    args = dict(key=jax.random.key(1), num_samples=2, max_new_tokens=12, eos_id=1, pad_id=0)
    return sampler.sample(CFG, params, PROMPTS, LENGTHS, **(args | kw))


_forward = jax.jit(functools.partial(model.forward, CFG), static_argnames="routing_mode")


def _full_forward(params, out):
    tokens, mask = out.training_inputs()
    full = _forward(params, tokens, attention_mask=mask)
    Tp = out.prompt_tokens.shape[1]
    logp = jax.nn.log_softmax(full.logits[:, Tp - 1 : -1], axis=-1)  # predicts completion t
    return full, logp, mask


def test_logps_entropies_and_trace_equal_the_full_forward(params):
    out = _sample(params)
    full, logp, mask = _full_forward(params, out)
    token_logp = jnp.take_along_axis(logp, out.tokens[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    np.testing.assert_allclose(out.logps[out.mask], token_logp[out.mask], atol=1e-4)
    np.testing.assert_allclose(out.entropies[out.mask], entropy[out.mask], atol=1e-4)
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


def test_greedy_is_argmax_of_the_full_forward(params):
    out = _sample(params, temperature=0.0)
    _, logp, _ = _full_forward(params, out)
    np.testing.assert_array_equal(out.tokens[out.mask], jnp.argmax(logp, -1)[out.mask])
    # The G samples of one prompt are identical under greedy decoding.
    np.testing.assert_array_equal(out.tokens[0::2], out.tokens[1::2])
    # top_k=1 and a tiny nucleus are greedy too.
    np.testing.assert_array_equal(_sample(params, top_k=1).tokens, out.tokens)
    np.testing.assert_array_equal(_sample(params, top_p=1e-6).tokens, out.tokens)


def test_seed_reproducibility(params):
    a, b = _sample(params), _sample(params)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    c = _sample(params, key=jax.random.key(7))
    assert (np.asarray(a.tokens) != np.asarray(c.tokens)).any()


def test_top_k_restricts_the_support(params):
    out = _sample(params, top_k=3, max_new_tokens=8)
    _, logp, _ = _full_forward(params, out)
    rank = jnp.sum(logp > jnp.take_along_axis(logp, out.tokens[..., None], -1), axis=-1)
    assert int(jnp.max(jnp.where(out.mask, rank, 0))) < 3


def test_fp8_params_sample_transparently(params):
    qparams = quant.quantize_fp8(params)
    out = _sample(qparams, temperature=0.0)
    assert out.tokens.shape == (6, 16) and int(out.lengths.max()) <= 12


def test_buckets_bound_compiles_and_budget(params):
    _sample(params, max_new_tokens=12)
    before = sampler.compile_count()
    # Another prompt length and budget inside the same buckets: no new compile.
    out = sampler.sample(
        CFG, params, PROMPTS[:, :7], np.array([7, 3, 5]), key=jax.random.key(2),
        num_samples=2, max_new_tokens=10, eos_id=1, pad_id=0,
    )  # fmt: skip
    assert sampler.compile_count() == before
    assert out.tokens.shape == (6, 16) and int(out.lengths.max()) <= 10
    with pytest.raises(
        ValueError, match=r"prompt length 40 exceeds the largest bucket 32 of \(16, 32\)"
    ):
        sampler.sample(
            CFG, params, np.ones((1, 40), int), np.array([40]), key=jax.random.key(0),
            num_samples=1, max_new_tokens=4, eos_id=1, pad_id=0,
            buckets=scheduling.LengthBuckets(prompt_buckets=(16, 32), generation_buckets=(16,)),
        )  # fmt: skip


def test_continuing_from_a_prefix_equals_one_pass(params):
    """Budget 4, then continue the unfinished rows from their prefixes: same as one pass."""
    prompts, mask = sampler.left_pad(PROMPTS, LENGTHS, width=16, pad_id=0)
    run = functools.partial(
        sampler.sample_chunk, sampler.EspoModel(CFG), params, jnp.asarray(prompts),
        jnp.asarray(mask), jax.random.key(0), num_samples=1, gen_len=16, temperature=0.0,
        top_p=1.0, top_k=0, ids=(1, 0),
    )  # fmt: skip
    whole = run(jnp.asarray(12))
    first = run(jnp.asarray(4))
    assert int(first.num_steps) <= 4 and (first.lengths <= 4).all()
    prefix = sampler.Prefix(
        tokens=first.tokens, lengths=first.lengths, logps=first.logps, entropies=first.entropies
    )
    rest = run(jnp.asarray(12), prefix)
    np.testing.assert_array_equal(rest.tokens, whole.tokens)
    np.testing.assert_array_equal(rest.lengths, whole.lengths)
    np.testing.assert_allclose(rest.logps, whole.logps, atol=1e-4)
    np.testing.assert_allclose(rest.entropies, whole.entropies, atol=1e-4)
    np.testing.assert_array_equal(rest.router.expert_ids, whole.router.expert_ids)


@pytest.mark.parametrize(
    ("top_k", "top_p", "kept"),
    [(0, 1.0, [0, 1, 2, 3]), (2, 1.0, [0, 1]), (0, 0.75, [0, 1, 2])],
)
def test_choose_tokens_samples_the_truncated_distribution(top_k, top_p, kept):
    # p = (0.4, 0.3, 0.2, 0.1) at temperature 2 (logits doubled); the nucleus 0.75 keeps 3.
    probs = np.array([0.4, 0.3, 0.2, 0.1])
    logits = jnp.tile(jnp.log(jnp.asarray(probs)) * 2.0, (40_000, 1))
    tokens, logps, entropies = sampler.choose_tokens(
        logits, jax.random.key(3), temperature=2.0, top_p=top_p, top_k=top_k
    )
    want = np.zeros(4)
    want[kept] = probs[kept] / probs[kept].sum()
    freq = np.bincount(np.asarray(tokens), minlength=4) / len(tokens)
    np.testing.assert_allclose(freq, want, atol=0.01)  # ~4 standard errors
    # logps / entropies are those of the untruncated tempered distribution.
    np.testing.assert_allclose(logps, np.log(probs)[np.asarray(tokens)], rtol=1e-5)
    np.testing.assert_allclose(entropies, -np.sum(probs * np.log(probs)), rtol=1e-5)
