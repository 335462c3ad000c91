"""Verifiable rewards and reward shaping.

A reward is `fn(prompt: str, completion: str, meta: Mapping) -> float`, a picklable top-level
function or frozen-dataclass instance with no state (they run in a process pool, where the
per-sample timeout is the pool's business). Modules:
  * `extract`: where the final answer is (last `\\boxed{}`, else a final-answer line).
  * `math`: symbolic equivalence to the gold via math-verify (`math_reward`, `MathReward`).
  * `procedural`: exact / numeric match and the format reward.
  * `shaping`: DAPO overlong and repetition penalties added to the verifiable reward.
"""

from espo.rewards import extract, math, procedural, shaping

__all__ = ["extract", "math", "procedural", "shaping"]
