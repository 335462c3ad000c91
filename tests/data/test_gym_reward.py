"""espo.rewards.gym.ReasoningGymReward on examples of a real reasoning_gym dataset."""

import json
import pickle

import pytest

from espo.data import examples, sources
from espo.rewards import gym


@pytest.fixture(scope="module")
def chain_sum():
    cfg = examples.DataConfig(
        tasks="chain_sum:min_terms=3:max_terms=3:difficulty=0.5", size=20, eval_fraction=0.3
    )
    train, _ = sources.make_sources(cfg)
    return list(train)


def test_right_and_wrong_answers(chain_sum):
    reward = gym.ReasoningGymReward()
    for e in chain_sum[:5]:
        assert reward(e.prompt, f"  {e.answer}\n", e.meta) == 1.0  # stripped
        assert reward(e.prompt, str(int(e.answer) + 1), e.meta) == 0.0
        assert reward(e.prompt, "", e.meta) == 0.0
    # The task's own scorer: chain_sum forgives a sign, leading zeros, decimals and commas.
    e = next(x for x in chain_sum if int(x.answer) > 0)
    assert reward(e.prompt, f"+0{e.answer}.00", e.meta) == 1.0


def test_completion_is_stripped_before_an_exact_scorer():
    # gcd scores with reasoning_gym's default: exact match 1, else len(gold)/len(text) when the
    # gold is inside, so unstripped "  6\n" would get 0.25.
    train, _ = sources.make_sources(examples.DataConfig(tasks="gcd", size=10, eval_fraction=0.2))
    reward = gym.ReasoningGymReward()
    for e in train:
        assert reward(e.prompt, f"  {e.answer} \n", e.meta) == 1.0
        assert reward(e.prompt, f"{e.answer}0", e.meta) == pytest.approx(
            len(e.answer) / (len(e.answer) + 1)
        )


def test_meta_after_json_and_pickle(chain_sum):
    e = chain_sum[0]
    reward = pickle.loads(pickle.dumps(gym.ReasoningGymReward()))
    meta = json.loads(json.dumps(e.meta))  # as a checkpoint or another process holds it
    assert reward(e.prompt, e.answer, meta) == 1.0


@pytest.mark.parametrize("key", ["task", "entry"])
def test_missing_meta_key_is_named(chain_sum, key):
    meta = {k: v for k, v in chain_sum[0].meta.items() if k != key}
    with pytest.raises(KeyError, match=f"meta has no '{key}'"):
        gym.ReasoningGymReward()("p", "1", meta)


def test_unknown_task_is_named(chain_sum):
    meta = {**chain_sum[0].meta, "task": "no_such_task"}
    with pytest.raises(ValueError, match="meta\\['task'\\]='no_such_task'"):
        gym.ReasoningGymReward()("p", "1", meta)
