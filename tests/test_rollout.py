"""generate_and_score: exact rollouts on a fake model, real distributions on the tiny model,
scheduling, overlap of rewards with decoding (proven by order of events, never elapsed time),
and a `Rollout` that is arrays only (texts and metrics beside it in the `RolloutResult`).
"""

import dataclasses
import functools
import os
import re
import threading
import time
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from espo import errors, model, rollout, sampler, scheduling, sharding, testing, train_step
from espo import types as espo_types
from espo.rewards import pool as pool_lib

V = 64
EOS = V - 1
SAMPLING = sampler.SamplingParams(max_new_tokens=40, stop_ids=(EOS,), pad_id=0)
BUCKETS = scheduling.LengthBuckets(prompt_buckets=(4, 8), generation_buckets=(8, 16, 32, 48))
CONFIG = rollout.RolloutSpec(sampling=SAMPLING, buckets=BUCKETS, max_chunk_size=4)
SIZES = [2, 1, 3, 2, 1, 2, 2, 1]
IDS = [f"q{i}" for i in range(8)]


def _prompts():
    # Last token t -> the completion counts t+1 .. 63 (EOS): length 63 - t, capped at 40.
    rng = np.random.RandomState(0)
    lasts = [62, 60, 55, 50, 40, 30, 20, 10]
    return [list(rng.randint(0, 60, size=1 + i % 6)) + [t] for i, t in enumerate(lasts)], lasts


@pytest.fixture(scope="module")
def reward_pool():
    # `str` is the workers' detokenizer: [61, 62] -> "[61, 62]".
    with pool_lib.RewardPool(testing.length_reward, num_workers=2, detokenize=str) as p:
        yield p


def _run(reward_pool, fake, **kw):
    """generate_and_score on the 8 prompts; RolloutSpec fields may be given as keywords."""
    prompts, _ = _prompts()
    fields = {f.name for f in dataclasses.fields(rollout.RolloutSpec)}
    config = dataclasses.replace(CONFIG, **{k: kw.pop(k) for k in fields & kw.keys()})
    args = dict(
        prompts=prompts, prompt_texts=[f"p{i}" for i in range(8)], metas=[{}] * 8,
        group_sizes=SIZES, key=jax.random.key(0), config=config, reward_pool=reward_pool,
    )  # fmt: skip
    if kw.get("predictor") is not None:
        args["prompt_ids"] = IDS
    return rollout.generate_and_score(fake, None, **(args | kw))


@pytest.mark.slow
def test_exact_rollout_continuations_rewards_and_trace(reward_pool):
    # A predictor that guesses 4 tokens: chunks get budget 8 and long rows must be continued.
    short = scheduling.LengthPredictor(default_length=4)
    result = _run(reward_pool, testing.CountingModel(vocab=V), predictor=short)
    out, metrics = result.rollout, result.metrics
    prompts, lasts = _prompts()
    np.testing.assert_array_equal(out.group_ids, np.repeat(np.arange(8), SIZES))
    for r, p in enumerate(out.group_ids):
        n = min(63 - lasts[p], 40)  # never truncated by the scheduler, only by max_new_tokens
        want = list(range(lasts[p] + 1, lasts[p] + 1 + n))
        assert out.lengths[r] == n and out.tokens[r, :n].tolist() == want
        assert out.finished[r] == (63 - lasts[p] <= 40)
        assert result.completions[r] == str(want)  # detokenized by a worker
        assert out.rewards[r] == pytest.approx(len(str(want)) / 10)
    assert out.reward_ok.all()
    # Rows that needed more than one chunk were continued (budget 8 < their length), and
    # their prefill was paid again.
    assert metrics["rollout/num_chunks"] > 5 and metrics["rollout/reprefill_positions"]
    # The router trace covers prompt + completion in the training layout (-1 on padding).
    tokens, mask = out.training_inputs()
    np.testing.assert_array_equal(out.router.expert_ids[:, 0, :, 0], np.where(mask, tokens % 3, -1))
    np.testing.assert_allclose(out.logps[out.mask], 0.0, atol=1e-6)
    # The sampler's dtypes, kept through the host buffers (a float64 / int64 buffer would
    # double the host copy and hand the update other dtypes than the sampler's).
    dtypes = dict(tokens=np.int32, lengths=np.int32, prompt_tokens=np.int32, logps=np.float32,
                  entropies=np.float32)  # fmt: skip
    assert {k: getattr(out, k).dtype for k in dtypes} == dtypes
    # The trace is ids only (replay recomputes the gates), int32 for a model that does not say
    # how many experts it has.
    assert (out.router.expert_ids.dtype, out.router.expert_weights) == (np.int32, None)
    # Metrics: the prompts ending in 20 and 10 run past max_new_tokens (43 and 53 > 40).
    truncated = [63 - lasts[p] > 40 for p in out.group_ids]
    assert metrics["rollout/truncated_fraction"] == pytest.approx(np.mean(truncated))
    assert metrics["rollout/useful_tokens"] == out.lengths.sum()
    assert metrics["rollout/mean_length"] == pytest.approx(out.lengths.mean())
    assert metrics["reward/num_ok"] == len(out.lengths) and metrics["reward/retries"] == 0
    # The timings are wall-clock, so only how they relate is checked: the call is decoding then
    # waiting on rewards, and tokens/s is the real tokens over the decoding time.
    total = metrics["rollout/generate_s"] + metrics["rollout/reward_wait_s"]
    assert metrics["rollout/total_s"] == pytest.approx(total)
    assert min(metrics["rollout/generate_s"], metrics["rollout/reward_wait_s"]) >= 0
    tokens_per_s = out.lengths.sum() / metrics["rollout/generate_s"]
    assert metrics["rollout/tokens_per_s"] == pytest.approx(tokens_per_s)
    # The predictor learnt each prompt's length under its id.
    np.testing.assert_allclose(
        short.predict([scheduling.Request(prompt_id=i, sample_index=0, prompt_length=1)
                       for i in IDS]),
        [min(63 - t, 40) for t in lasts],
    )  # fmt: skip


@pytest.mark.slow
def test_new_compiles_counts_the_sampler_compilations_of_the_call(reward_pool):
    fake = testing.CountingModel(vocab=V)
    before = sampler.compile_count()
    first = _run(reward_pool, fake, max_chunk_size=3)  # a batch no other test here decodes
    assert first.metrics["rollout/new_compiles"] == sampler.compile_count() - before > 0
    again = _run(reward_pool, fake, max_chunk_size=3)  # the same shapes: nothing to compile
    assert again.metrics["rollout/new_compiles"] == 0


@pytest.mark.slow
def test_host_detokenization_gives_the_same_rollout(reward_pool):
    fake = testing.CountingModel(vocab=V)
    in_workers = _run(reward_pool, fake)
    on_host = _run(reward_pool, fake, detokenize=lambda t: str(t))
    assert on_host.completions == in_workers.completions
    chex.assert_trees_all_equal(on_host.rollout, in_workers.rollout)
    m = on_host.metrics  # the second call on this pool: its own counts, its own hand-off time
    assert m["reward/num_ok"] == len(on_host.rollout.lengths) == sum(SIZES)
    assert 0 < m["rollout/host_handoff_s"] <= m["rollout/generate_s"]
    want = (
        "detokenize=None needs a reward pool that detokenizes: RewardPool(reward_fn, "
        "detokenize=tokenizer.decode), or pass detokenize="
    )
    with pool_lib.RewardPool(testing.length_reward, num_workers=1) as plain:
        with pytest.raises(ValueError, match=re.escape(want) + "$"):
            _run(plain, fake)
        # A pool without a detokenizer is fine when the host detokenizes.
        assert _run(plain, fake, detokenize=str).completions == in_workers.completions


# Raises for prompts whose meta asks for it.
FAILING = testing.FromSource(
    """
def reward(prompt, completion, meta):
    if meta.get("fail"):
        raise ValueError("no answer found")
    return len(completion) / 10
"""
)


def test_failed_rewards_are_flagged_and_counted():
    fake = testing.CountingModel(vocab=V)
    metas = [{"fail": p in (1, 4)} for p in range(8)]
    with pool_lib.RewardPool(FAILING, num_workers=2, detokenize=str, failed_reward=-3.0) as p:
        result = _run(p, fake, metas=metas)
    out = result.rollout
    bad = np.isin(out.group_ids, [1, 4])
    np.testing.assert_array_equal(out.reward_ok, ~bad)
    assert (out.rewards[bad] == -3.0).all() and (out.rewards[~bad] > 0).all()
    assert result.metrics["reward/num_error"] == bad.sum() == 2
    assert all(c.startswith("[") for c in result.completions)  # scored text kept for failed ones


class _Wrapper:
    """A SamplingModel around `self.inner` (a CountingModel): all but `forward` is the inner's."""

    num_layers = property(lambda self: self.inner.num_layers)
    top_k = property(lambda self: self.inner.top_k)

    def init_cache(self, **kw):
        return self.inner.init_cache(**kw)


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: a fresh jit trace
class _BatchRecorder(_Wrapper):
    """CountingModel that records the batch of every traced forward (prefill and decode)."""

    inner: testing.CountingModel
    batches: set = dataclasses.field(default_factory=set)

    def forward(self, params, tokens, **kw):
        self.batches.add(tokens.shape[0])
        return self.inner.forward(params, tokens, **kw)


@pytest.mark.slow
def test_chunks_decode_in_their_planned_batch(reward_pool):
    """Every chunk decodes at its bucketed batch (its rows, then copies of its first row up to
    the batch size): the compiled batches are the plan's, never above max_chunk_size."""
    fake = _BatchRecorder(testing.CountingModel(vocab=V))
    out = _run(reward_pool, fake, predictor=scheduling.LengthPredictor(default_length=4))
    assert out.metrics["rollout/num_chunks"] > 5  # continuations too
    assert fake.batches and max(fake.batches) <= CONFIG.max_chunk_size, fake.batches


def test_fifo_and_length_aware_agree_and_waste_less(reward_pool):
    fake = testing.CountingModel(vocab=V)
    predictor = scheduling.LengthPredictor()
    _run(reward_pool, fake, predictor=predictor)  # one step of history
    aware = _run(reward_pool, fake, predictor=predictor)
    fifo = _run(reward_pool, fake, predictor=predictor, schedule="fifo")  # the same history
    # The same samples, whatever the order they were decoded in (log-probs ~1e-12 here).
    chex.assert_trees_all_close(aware.rollout, fifo.rollout, atol=1e-6)
    assert aware.completions == fifo.completions
    assert aware.metrics["rollout/padding_waste"] < fifo.metrics["rollout/padding_waste"]


@pytest.mark.slow
def test_chunks_are_balanced_over_the_shards(reward_pool, monkeypatch):
    """num_shards reaches every plan (first wave and continuations) and the metrics."""
    seen = []

    def spy(fn):
        @functools.wraps(fn)
        def wrapped(*args, **kw):
            chunks = fn(*args, **kw)
            seen.append((fn.__name__, kw.get("num_shards", 1), [c.shard for c in chunks]))
            return chunks

        return wrapped

    for name in ("plan_chunks", "plan_fifo", "continuation_plan"):
        monkeypatch.setattr(scheduling, name, spy(getattr(scheduling, name)))
    fake, short = testing.CountingModel(vocab=V), scheduling.LengthPredictor(default_length=4)
    out = _run(reward_pool, fake, predictor=short, num_shards=3, max_chunk_size=2)
    names = [name for name, _, _ in seen]
    assert names[0] == "plan_chunks" and "continuation_plan" in names
    assert all(n == 3 for _, n, _ in seen)
    assert {s for _, _, shards in seen[:1] for s in shards} == {0, 1, 2}  # 8 chunks on 3
    assert 1.0 < out.metrics["rollout/shard_imbalance"] < 3.0
    one = _run(reward_pool, fake, predictor=short, max_chunk_size=2)
    assert one.metrics["rollout/shard_imbalance"] == 1.0
    # shards change the plan, not the samples
    chex.assert_trees_all_close(one.rollout, out.rollout, atol=1e-6)


# ---------------------------------------------------------------- overlap, by order of events

# The first sample to start creates <dir>/reward_started and returns only once <dir>/decoded
# exists, which the model writes from a decode step that sees reward_started: the reward
# finishes only if a decode step runs while it does (else TimeoutError -> reward_ok False).
WAIT_FOR_DECODE = testing.FromSource(
    """
def reward(prompt, completion, meta):
    import os, time
    try:
        os.close(os.open(os.path.join(meta["dir"], "reward_started"), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return len(completion) / 10
    deadline = time.monotonic() + meta["wait_s"]
    while not os.path.exists(os.path.join(meta["dir"], "decoded")):
        if time.monotonic() > deadline:
            raise TimeoutError("no decode step ran while this reward ran")
        time.sleep(0.002)
    return len(completion) / 10
"""
)


class _Probe:
    """Decode-side half of the handshake (hashable by identity: the model is a jit static)."""

    def __init__(self, directory, wait_s):
        self.dir, self.wait_s = directory, wait_s
        self.submitted = threading.Event()
        self.events: list[str] = []

    def on_decode_step(self):
        if self.submitted.is_set() and "decoded" not in self.events:
            self.events.append("decode step after a submission")
            deadline = time.monotonic() + self.wait_s
            while not os.path.exists(os.path.join(self.dir, "reward_started")):
                if time.monotonic() > deadline:
                    raise TimeoutError("no reward started while decoding")
                time.sleep(0.002)
            self.events.append("reward started")
            open(os.path.join(self.dir, "decoded"), "w").close()
            self.events.append("decoded")


@dataclasses.dataclass(frozen=True)
class _ProbedModel(_Wrapper):
    """CountingModel whose every forward calls `probe.on_decode_step()` on the host."""

    inner: testing.CountingModel
    probe: _Probe

    def forward(self, params, tokens, *, attention_mask, cache):
        out = self.inner.forward(params, tokens, attention_mask=attention_mask, cache=cache)

        def step(x):
            self.probe.on_decode_step()
            return np.zeros_like(x)

        shape = jax.ShapeDtypeStruct(out.logits.shape, out.logits.dtype)
        return out.replace(logits=out.logits + jax.pure_callback(step, shape, out.logits))


class _SignallingPool:
    """A RewardPool that tells the probe when the rollout first submits samples."""

    def __init__(self, inner, probe):
        self.inner, self.probe, self.detokenize = inner, probe, inner.detokenize

    def submit(self, items):
        ids = self.inner.submit(items)
        self.probe.submitted.set()
        return ids

    def results(self, ids, **kw):
        return self.inner.results(ids, **kw)

    def metrics(self):
        return self.inner.metrics()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_rewards_overlap_generation(tmp_path):
    """A reward of an early chunk starts, a decode step runs, then the reward ends.

    Order of events, forced by a handshake: the first decode step after the first submission
    waits for a reward to start; that reward waits for the decode step. If rewards ran only after
    generation (or blocked it), one side would wait forever (here: TimeoutError, a failure).
    There is always a decode step after the first submission: chunk 3 is dispatched only after
    chunk 1 is handed off (4 chunks here).
    """
    probe = _Probe(str(tmp_path), wait_s=30)
    meta = {"dir": str(tmp_path), "wait_s": 30}
    with pool_lib.RewardPool(WAIT_FOR_DECODE, num_workers=2, timeout_s=100, detokenize=str) as p:
        out = _run(
            _SignallingPool(p, probe),
            _ProbedModel(testing.CountingModel(vocab=V), probe),
            metas=[meta] * 8,
        )
    assert out.rollout.reward_ok.all(), out.metrics
    assert probe.events == ["decode step after a submission", "reward started", "decoded"]
    assert out.metrics["rollout/num_chunks"] >= 3


class _CountingPool(_SignallingPool):
    """Records the size of every submit call."""

    def __init__(self, inner):
        super().__init__(inner, _Probe("", 0))
        self.calls: list[int] = []

    def submit(self, items):
        self.calls.append(len(items))
        return super().submit(items)


def test_without_overlap_every_sample_is_scored_after_decoding(reward_pool):
    # overlap_rewards=False (the system table's baseline): one submission of all N samples once
    # the last chunk is decoded, instead of one per chunk; the same rollout and rewards.
    fake = testing.CountingModel(vocab=V)
    overlapped, serial = _CountingPool(reward_pool), _CountingPool(reward_pool)
    a = _run(overlapped, fake)
    b = _run(serial, fake, overlap_rewards=False)
    n = len(a.rollout.rewards)
    assert (
        len(overlapped.calls) == a.metrics["rollout/num_chunks"] > 1 and sum(overlapped.calls) == n
    )
    assert serial.calls == [n]
    np.testing.assert_array_equal(a.rollout.rewards, b.rollout.rewards)
    np.testing.assert_array_equal(a.rollout.tokens, b.rollout.tokens)
    assert a.completions == b.completions


# ---------------------------------------------------------------- the tiny real model

CFG = model.ModelConfig.tiny(vocab_size=V)
MODEL = model.Model(CFG)
TINY_BUCKETS = scheduling.LengthBuckets(prompt_buckets=(8,), generation_buckets=(4, 8, 16))


@pytest.fixture(scope="module")
def params():
    return MODEL.init(jax.random.key(0))


def _run_tiny(params, reward_pool, *, key=0, temperature=1.0, group_sizes=(4, 3)):
    rng = np.random.RandomState(0)
    prompts = [list(rng.randint(2, V, 7)), list(rng.randint(2, V, 5))]
    sampling = sampler.SamplingParams(
        max_new_tokens=16, stop_ids=(1,), pad_id=0, temperature=temperature
    )
    return rollout.generate_and_score(
        MODEL, params, prompts=prompts, prompt_texts=["a", "b"], metas=[{}, {}],
        group_sizes=list(group_sizes), key=jax.random.key(key),
        config=rollout.RolloutSpec(sampling=sampling, buckets=TINY_BUCKETS, max_chunk_size=2),
        reward_pool=reward_pool,
        # Budget 4: every row not done after 4 tokens is continued (to 8, then 16).
        predictor=scheduling.LengthPredictor(default_length=2), prompt_ids=["a", "b"],
    )  # fmt: skip


@pytest.mark.slow
def test_chunks_draw_independently_and_a_key_reproduces(params, reward_pool):
    """G=4 samples of prompt 0 fill chunks (0, 1) and (2, 3): rows 0 and 2 sit at chunk row 0 in
    two chunks. With one key for every chunk they would be identical (a fake zero-variance
    group); with fold_in(key, chunk) all samples differ. The same key reproduces exactly."""
    out = _run_tiny(params, reward_pool).rollout
    first = out.tokens[out.group_ids == 0]
    assert len({tuple(row) for row in first}) == 4, first
    again = _run_tiny(params, reward_pool).rollout
    chex.assert_trees_all_equal(again, out)  # bit for bit, every array of the rollout
    other = _run_tiny(params, reward_pool, key=1).rollout
    assert not np.array_equal(other.tokens, out.tokens)


@pytest.mark.slow
def test_logps_and_entropies_equal_a_recompute_on_continued_rows(params, reward_pool):
    """Per-token log-probs and entropies, prefix positions of continued rows included, equal a
    full forward of the model over the returned prompt + completion:
    logp_t = log_softmax(logits_{t-1} / T)[token_t], H_t = -sum_v p_v log p_v (full vocab)."""
    temperature = 0.7
    result = _run_tiny(params, reward_pool, temperature=temperature)
    out = result.rollout
    assert result.metrics["rollout/num_chunks"] > 4  # waves of continuations (budget 4, 8, 16)
    continued = out.lengths > 4
    assert continued.sum() >= 3
    tokens, mask = out.training_inputs()
    recomputed = jax.jit(  # op by op: ~170 small programs
        functools.partial(train_step.token_logps, CFG, temperature=temperature)
    )(params, jnp.asarray(tokens), jnp.asarray(mask))
    Tp = out.prompt_tokens.shape[1]
    token_logp = np.asarray(train_step.completion(recomputed.logps, prompt_length=Tp))
    entropy = np.asarray(train_step.completion(recomputed.entropies, prompt_length=Tp))
    m = out.mask
    np.testing.assert_allclose(out.logps[m], token_logp[m], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(out.entropies[m], entropy[m], atol=1e-4, rtol=1e-4)
    # Not degenerate: entropies are positive and far from the log-probs.
    assert (out.entropies[m] > 0.5).all() and (out.logps[m] < -0.5).mean() > 0.5
    assert (out.logps[~m] == 0).all() and (out.entropies[~m] == 0).all()


_BIG = sampler.SamplingParams(max_new_tokens=49, stop_ids=(EOS,), pad_id=0)
_TEXTS = [f"p{i}" for i in range(8)]
_INT = "an int >= 1"
_SIZES = "is invalid: an int >= 1, or one int >= 1 per prompt (8 prompts)"
BAD_ARGUMENTS = [  # (keywords of `_run`, the field an InvalidValue names, or a shape error's text)
    (dict(sampling="greedy"), "sampling"),
    (dict(buckets=(8, 16)), "buckets"),
    (dict(max_chunk_size=0), "max_chunk_size"),
    (dict(max_chunk_size=True), "max_chunk_size"),
    (dict(max_chunk_size=4.0), "max_chunk_size"),
    (dict(schedule="lifo"), "schedule"),
    (dict(num_shards=0), "num_shards"),
    (dict(num_shards=False), "num_shards"),
    (dict(overlap_rewards=1), "overlap_rewards"),
    (dict(sampling=_BIG), "max_new_tokens"),
    (dict(config=None), "config"),
    (dict(prompt_texts=_TEXTS[:7]), "prompts (8), prompt_texts (7) and metas (8) must have "
     "the same length"),
    (dict(metas=[{}] * 9), "prompts (8), prompt_texts (8) and metas (9) must have the same "
     "length"),
    (dict(prompts=[], prompt_texts=[], metas=[]), "prompts is empty: a rollout needs at "
     "least one prompt"),
    (dict(prompts=[[1]] * 2 + [[]] + [[2]] * 2 + [[]] * 3), "prompts [2, 5, 6, 7] have no "
     "tokens: every prompt needs >= 1 token"),
    (dict(prompts=[[]] * 9, prompt_texts=_TEXTS + ["p8"], metas=[{}] * 9, group_sizes=1),
     "prompts [0, 1, 2, 3, 4, 5, 6, 7] have no tokens: every prompt needs >= 1 token"),
    (dict(group_sizes=0), "group_sizes"),
    (dict(group_sizes=True), "group_sizes"),
    (dict(group_sizes=2.0), "group_sizes"),
    (dict(group_sizes=[2] * 7), "group_sizes"),
    (dict(group_sizes=[2] * 7 + [0]), "group_sizes"),
    (dict(group_sizes=[2] * 7 + [2.0]), "group_sizes"),
    (dict(predictor=scheduling.LengthPredictor(), prompt_ids=None), "prompt_ids=None with a "
     "predictor: its history is keyed by prompt id, and batch positions would share history "
     "between different prompts; pass the data pipeline's stable prompt ids (or "
     "predictor=None for no history)"),
    (dict(prompt_ids=IDS[:7]), "prompt_ids has 7 ids for 8 prompts"),
]  # fmt: skip


@pytest.mark.parametrize("kw, message", BAD_ARGUMENTS, ids=lambda x: str(x)[:40])
def test_every_bad_argument_is_refused_before_decoding_with_its_whole_message(
    reward_pool, kw, message
):
    """Each check of `RolloutSpec` and `generate_and_score`, with a value just past what it
    accepts (0, a bool or a float for an int, one element too few or too many). The model is
    not one: every check runs before the model is looked at."""
    with pytest.raises(ValueError) as error:
        _run(reward_pool, "not a model", **kw)
    if isinstance(error.value, errors.InvalidValue):
        assert error.value.field == message
    else:
        assert str(error.value) == message


@pytest.mark.slow
def test_arguments_at_the_edge_of_what_is_valid_are_accepted(reward_pool):
    """max_new_tokens equal to the largest generation bucket, chunks of one row, numpy integers
    for the counts, one int G for every prompt."""
    assert dataclasses.replace(CONFIG, max_chunk_size=1, num_shards=1).max_chunk_size == 1
    fake = testing.CountingModel(vocab=V)
    edge = sampler.SamplingParams(max_new_tokens=48, stop_ids=(EOS,), pad_id=0)
    out = _run(
        reward_pool, fake, sampling=edge, max_chunk_size=np.int64(8), num_shards=np.int32(1),
        group_sizes=np.int64(2), overlap_rewards=False,
    )  # fmt: skip
    np.testing.assert_array_equal(out.rollout.group_ids, np.repeat(np.arange(8), 2))
    assert out.rollout.lengths.max() == 48  # prompt 7 counts from 10: 53 tokens, capped


def test_rollouts_differing_in_text_share_one_compile(reward_pool):
    """Texts and metrics travel beside the Rollout (arrays only), so a jitted function of two
    rollouts with other completions, prompt texts and metrics compiles once. (A static text
    field in the pytree would make the second call a cache miss.)"""
    fake = testing.CountingModel(vocab=V)
    first = _run(reward_pool, fake)
    other = _run(reward_pool, fake, prompt_texts=[f"other {i}" for i in range(8)])
    assert isinstance(first.rollout, espo_types.Rollout) and first.completions
    assert all(isinstance(leaf, np.ndarray) for leaf in jax.tree.leaves(first.rollout))
    traces = []

    @jax.jit
    def total(r):
        traces.append(r)  # runs once per trace, i.e. once per cache miss
        return jnp.sum(r.logps * r.mask) + jnp.sum(r.rewards)

    total(first.rollout)
    total(other.rollout)
    assert len(traces) == 1
    chex.assert_trees_all_equal_structs(first.rollout, other.rollout)


@pytest.mark.slow
def test_continued_rows_keep_their_prefix_so_lengths_follow_the_policy(reward_pool):
    """Rows continue from what they generated, so the lengths are the policy's. Here a uniform
    policy over 8 tokens, one of them the stop id: lengths are geometric, P(L <= 4) = 1 - (7/8)^4
    = 0.414 and E[min(L, 32)] = 8 (1 - (7/8)^32) = 7.89. Every row is planned with budget 4 and
    continued in waves; a continuation that restarted from the prompt (prefix dropped) would
    redraw the rows that ran long, keeping short draws (P(L <= 4) 0.72 with this key)."""
    fake = testing.CountingModel(vocab=8, sharpness=0.0)
    sampling = sampler.SamplingParams(max_new_tokens=32, stop_ids=(7,), pad_id=0)
    buckets = scheduling.LengthBuckets(prompt_buckets=(4,), generation_buckets=(4, 8, 16, 32))
    result = rollout.generate_and_score(
        fake, None, prompts=[[1, 2], [3]], prompt_texts=["a", "b"], metas=[{}, {}],
        group_sizes=128, key=jax.random.key(5), reward_pool=reward_pool,
        config=rollout.RolloutSpec(sampling=sampling, buckets=buckets, max_chunk_size=32),
        predictor=scheduling.LengthPredictor(default_length=2), prompt_ids=["a", "b"],
    )  # fmt: skip
    lengths = result.rollout.lengths  # 256 rows: standard errors 0.031 and 0.43
    assert result.metrics["rollout/reprefill_positions"] > 0  # rows were continued
    assert abs(np.mean(lengths <= 4) - 0.414) < 0.08, np.mean(lengths <= 4)
    assert abs(lengths.mean() - 7.89) < 1.1, lengths.mean()


class _Clock:
    """A `time` stand-in whose perf_counter advances by 1/64 s at every call (exact in binary)."""

    def __init__(self):
        self.calls = 0

    def perf_counter(self):
        self.calls += 1
        return self.calls / 64


@pytest.mark.slow
def test_timings_add_up_every_hand_off_on_a_fake_clock(reward_pool, monkeypatch):
    """On a clock that ticks once per reading, the timings are counts of readings: the call
    reads t0, then two per hand-off (one per chunk), then t_generated and t_end, so
    generate_s = (1 + 2 H) / 64, host_handoff_s = H / 64 (each hand-off's time added, not the
    last one kept), reward_wait_s = 1 / 64 and tokens/s = tokens / generate_s, a generation
    faster than one second included."""
    clock = _Clock()
    monkeypatch.setattr(rollout, "time", clock)
    fake = testing.CountingModel(vocab=V)
    out = _run(reward_pool, fake, predictor=scheduling.LengthPredictor(default_length=4))
    m, hand_offs = out.metrics, out.metrics["rollout/num_chunks"]
    assert hand_offs > 5 and clock.calls == 3 + 2 * hand_offs
    assert m["rollout/generate_s"] == (1 + 2 * hand_offs) / 64 < 1
    assert m["rollout/host_handoff_s"] == hand_offs / 64
    assert m["rollout/reward_wait_s"] == 1 / 64
    assert m["rollout/total_s"] == (2 + 2 * hand_offs) / 64
    tokens = int(out.rollout.lengths.sum())
    assert m["rollout/tokens_per_s"] == pytest.approx(tokens / m["rollout/generate_s"], rel=1e-12)


def test_chunk_n_draws_from_fold_in_key_n_across_waves(reward_pool, monkeypatch):
    """The documented key contract: the n-th chunk dispatched (continuation waves included)
    samples with fold_in(key, n), n = 1, 2, ...; a recorded rollout can be replayed from it."""
    keys = []
    sample_chunk = sampler.sample_chunk

    def spy(model, params, tokens, mask, key, *args, **kw):
        keys.append(jax.random.key_data(key))
        return sample_chunk(model, params, tokens, mask, key, *args, **kw)

    monkeypatch.setattr(sampler, "sample_chunk", spy)
    fake = testing.CountingModel(vocab=V)
    out = _run(reward_pool, fake, predictor=scheduling.LengthPredictor(default_length=4))
    n = int(out.metrics["rollout/num_chunks"])
    assert len(keys) == n and out.metrics["rollout/reprefill_positions"] > 0
    expected = [
        jax.random.key_data(jax.random.fold_in(jax.random.key(0), i)) for i in range(1, n + 1)
    ]
    np.testing.assert_array_equal(np.stack(keys), np.stack(expected))


@pytest.mark.parametrize(
    ("field", "value"),
    [("param_layout", "tensor"), ("schedule", "lifo"), ("offload_state", "yes")],
)
def test_the_rollout_section_names_a_bad_field(field, value):
    with testing.raises_invalid(field):
        rollout.RolloutConfig(**{field: value})


def test_offloading_the_state_needs_host_memory(monkeypatch):
    """rollout.offload_state on a backend whose devices have no host memory kind: a
    ConfigError naming the key, before anything compiles."""
    sharding.check_host_memory("--config.rollout", "offload_state")  # this CPU has it
    no_host = types.SimpleNamespace(
        addressable_memories=lambda: [types.SimpleNamespace(kind="device")]
    )
    monkeypatch.setattr(jax, "local_devices", lambda: [no_host])
    with testing.raises_invalid("offload_state", where="--config.rollout", kind=errors.ConfigError):
        sharding.check_host_memory("--config.rollout", "offload_state")
