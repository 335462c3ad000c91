"""The default espo configuration (a tiny MoE that runs on a laptop CPU).

Run:  python experiments/run.py --config configs/default.py
      python experiments/run.py --config configs/default.py:tiny --config.demo.batch=4
      python experiments/run.py --config configs/default.py --config.model.hf_path=/ckpt/dir

`get_config(arg)` takes a variant string: "" (default) or "tiny" (the smallest shapes, used by the
tests). Library modules never read this ConfigDict: `experiments/run.py` turns each section into
the frozen, validated dataclass of the module that owns it.
"""

import ml_collections


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    variant = arg or "default"
    if variant not in ("default", "tiny"):
        raise ValueError(
            f"configs/default.py: variant {variant!r} is invalid; valid: default, tiny"
        )
    c = ml_collections.ConfigDict()
    c.seed = 0  # PRNG seed of parameter init and sampling
    c.workdir = "runs/default"  # where outputs of the run are written

    # ---- model: espo.model.ModelConfig fields, or a Hugging Face checkpoint directory ---------
    c.model = ml_collections.ConfigDict()
    c.model.hf_path = ""  # local Qwen3-MoE / Mixtral checkpoint dir; overrides the fields below
    c.model.vocab_size = 512  # V
    c.model.d_model = 128  # D
    c.model.num_layers = 4  # L
    c.model.num_heads = 4  # H query heads
    c.model.num_kv_heads = 2  # N key/value heads
    c.model.head_dim = 32  # per-head width
    c.model.num_experts = 16  # E routed experts
    c.model.top_k = 4  # K experts per token
    c.model.moe_ffn_dim = 128  # F hidden width of one expert
    c.model.qk_norm = True  # Qwen3-style q/k RMSNorm
    c.model.norm_topk_prob = True  # renormalise the top-k gates
    c.model.rope_theta = 10000.0  # RoPE base
    c.model.param_dtype = "float32"  # parameter storage dtype
    c.model.dtype = "float32"  # activation / matmul dtype
    c.model.aux_loss_coef = 0.001  # load-balancing loss weight
    c.model.z_loss_coef = 0.0  # router z-loss weight

    # ---- demo: what `make run` shows until the RL trainer lands --------------------------------
    c.demo = ml_collections.ConfigDict()
    c.demo.batch = 8  # prompts
    c.demo.prompt_length = 16  # tokens per random prompt
    c.demo.new_tokens = 16  # greedy tokens decoded with the KV cache
    c.demo.update_scale = 0.02  # relative size of the simulated policy update (router replay demo)

    if variant == "tiny":
        c.model.update(vocab_size=256, d_model=64, num_layers=2, num_experts=8, top_k=2)
        c.model.update(head_dim=16, moe_ffn_dim=64)
        c.demo.update(batch=2, prompt_length=8, new_tokens=4)
    return c
