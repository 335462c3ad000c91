"""The input pipeline: prompts with stable ids, the training stream and tokenizers.

Modules:
  * `chains`: the default task (+ / - chains, a flawed teacher's demonstrations, the verifier
    `ChainReward` and the process check).
  * `examples`: `Example` (id, prompt, answer, difficulty, meta) and `DataConfig` (the `data`
    config section, validated).
  * `sources`: `make_sources(cfg) -> (train, held_out)`, grain random-access sources over
    chains, reasoning_gym tasks, JSONL / Parquet files and TFDS (ArrayRecord) datasets;
    malformed records are errors naming file and line, or skipped and counted; the held-out
    set's dev / test halves.
  * `stream`: `PromptStream`, the shuffled, repeating, checkpointable stream of training
    Examples (grain), with an accept filter.
  * `tokenizer`: `CharTokenizer` (the procedural default), `HfTokenizer` (tokenizer.json plus
    the chat template rendered as transformers does), `load_tokenizer`, `check_vocab`.
  * `worked`: worked (step-by-step) solutions of + / - chains for the supervised warm start.
The verifier for reasoning_gym examples is `espo.rewards.gym.ReasoningGymReward`.
"""

import importlib

_SUBMODULES = ("chains", "examples", "sources", "stream", "tokenizer", "worked")
__all__ = list(_SUBMODULES)


def __getattr__(name):  # lazy: a reward worker unpickling a tokenizer imports only that module
    if name in _SUBMODULES:
        return importlib.import_module(f"espo.data.{name}")
    raise AttributeError(f"module 'espo.data' has no attribute {name!r}")
