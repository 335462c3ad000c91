"""Verifiable rewards and reward shaping.

A reward is `fn(prompt: str, completion: str, meta: Mapping) -> float`, a picklable top-level
function or frozen-dataclass instance with no state (they run in a process pool, where the
per-sample timeout is the pool's business). Modules:
  * `extract`: where the final answer is (last `\\boxed{}`, else a final-answer line).
  * `math`: symbolic equivalence to the gold via math-verify (`math_reward`, `MathReward`).
  * `procedural`: exact / numeric match and the format reward.
  * `gym`: reasoning_gym's own per-task scorer (`ReasoningGymReward`).
  * `shaping`: DAPO overlong and repetition penalties added to the verifiable reward.
  * `pool`: the process pool that scores samples with per-sample timeouts.
  * `reward_model`: advantage-inversion metrics, `adjust_rewards` (correctness tiers, tie
    dead-zone, ranks) and a Bradley-Terry reward model on the espo backbone.
  * `judge`: round-robin Better / Tie / Worse rewards from a pairwise judge (`JudgeScores`,
    never verifiable: judge-only groups with no spread go to zero-variance elimination).
  * `generative_judge`: the pairwise judge backed by an espo model and a prompt template.
  * `pair_judge`: a trained Better / Tie / Worse classifier judge on the espo backbone.
  * `model_rewards`: the trainer's reward-model stage (`reward.model_path`): a saved BT RM
    (or a pair judge) scores every rollout; naive / dead_zone / adjusted / judge rewards and the
    inversion they cause.
"""

import importlib

_SUBMODULES = (
    "extract",
    "generative_judge",
    "gym",
    "judge",
    "math",
    "model_rewards",
    "pair_judge",
    "pool",
    "procedural",
    "reward_model",
    "shaping",
)
__all__ = list(_SUBMODULES)


def __getattr__(name):  # lazy: a reward worker imports only the module its function lives in
    if name in _SUBMODULES:
        return importlib.import_module(f"espo.rewards.{name}")
    raise AttributeError(f"module 'espo.rewards' has no attribute {name!r}")
