"""The default espo configuration (a tiny MoE that runs on a laptop CPU).

Run:  python experiments/run.py --config configs/default.py
      python experiments/run.py --config configs/default.py:tiny --config.demo.batch=4
      python experiments/run.py --config configs/default.py --config.model.hf_path=/ckpt/dir

`get_config(arg)` takes a variant string: "" (default) or "tiny" (the smallest shapes, used by the
tests). Library modules never read this ConfigDict: `experiments/run.py` turns each section into
the frozen, validated dataclass of the module that owns it.
"""

import ml_collections
from ml_collections import config_dict

_float = config_dict.placeholder(float)  # "None: the library's default for this setting"
_int = config_dict.placeholder(int)


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

    # ---- rollout: espo.sampler.SamplingParams + scheduling (names as in vLLM / verl) ----------
    c.rollout = ml_collections.ConfigDict()
    c.rollout.max_new_tokens = 1024  # hard cap on completion length (the only truncation)
    c.rollout.temperature = 1.0  # sampling temperature (0 = greedy)
    c.rollout.top_p = 1.0  # nucleus mass kept
    c.rollout.top_k = 0  # 0 = no top-k truncation
    c.rollout.fp8 = True  # sample from FP8 (e4m3) weights; training stays in param_dtype
    c.rollout.max_chunk_size = 64  # rows decoded together
    c.rollout.schedule = "length_aware"  # or "fifo"
    c.rollout.reward_workers = 2  # reward process pool size
    c.rollout.reward_timeout_s = 10.0  # per-sample reward timeout

    # ---- loss: espo.losses.LossConfig ----------------------------------------------------------
    c.loss = ml_collections.ConfigDict()
    c.loss.name = "espo"  # grpo | gspo | espo | cispo
    c.loss.agg = config_dict.placeholder(str)  # aggregation; None = the loss's default
    c.loss.clip_low = _float  # None = the loss's default (grpo 0.2, gspo 3e-4)
    c.loss.clip_high = _float  # None = the loss's default (grpo 0.2, gspo 4e-4)
    c.loss.dual_clip = _float  # dual-clip constant for A < 0 (e.g. 3.0); None = off
    c.loss.norm_length = _int  # seq-mean-token-sum-norm divisor; None = T
    c.loss.top_frac = 0.2  # ESPO: share of tokens in the high-entropy group
    c.loss.num_groups = 2  # ESPO: entropy groups per sequence
    c.loss.quantile_scope = "sequence"  # ESPO: entropy quantiles per sequence or per batch
    c.loss.alpha = 0.02  # ESPO: eps = alpha * mean group entropy / log|V|
    c.loss.espo_ratio = "gspo_token"  # ESPO ratio reading: gspo_token | literal (Eq. 9)
    c.loss.kl_coef = 0.0  # beta of the KL to the reference policy (0 = no reference)
    c.loss.kl_estimator = "k3"  # k1 | k2 | k3
    c.loss.overlong_filter = False  # DAPO: truncated samples (no EOS) leave the loss

    # ---- zve: espo.zero_variance.ZveConfig (multi-stage zero-variance elimination) -------------
    c.zve = ml_collections.ConfigDict()
    c.zve.mode = "rl_zvp"  # optimiser stage: resample | rl_zvp | drop
    c.zve.max_resample_rounds = 4  # resample: extra generation rounds at most
    c.zve.oversample = 1.0  # resample: min prompts drawn per missing group
    c.zve.max_oversample = 4.0  # resample: max prompts drawn per missing group
    c.zve.max_carry_over_steps = 0  # resample: steps a leftover group is kept (0: none, as DAPO)
    c.zve.atol = 1e-6  # rewards closer than this count as equal
    c.zve.prefilter = "drop"  # offline pass-rate pre-filter: drop | downweight | off
    c.zve.prefilter_low = 0.0  # pass rate <= this is filtered
    c.zve.prefilter_high = 1.0  # pass rate >= this is filtered
    c.zve.prefilter_downweight = 0.1  # sampling weight of filtered prompts in downweight mode
    c.zve.group_size = 8  # G for prompts with no pass-rate history
    c.zve.max_group_size = 8  # adaptive G up to this (== group_size: adaptive G off)
    c.zve.zvp_target = 0.5  # adaptive G: smallest G with p^G + (1-p)^G below this
    c.zve.rollout_budget = _int  # cap on the sum of G per step; None = no cap

    # ---- reward: shaping (espo.rewards.shaping) and RM adjustment (reward_model) ----------------
    c.reward = ml_collections.ConfigDict()
    c.reward.shaping = ml_collections.ConfigDict()
    c.reward.shaping.overlong_weight = 1.0  # weight of the DAPO soft overlong penalty
    c.reward.shaping.max_length = 1024  # L_max of the overlong penalty
    c.reward.shaping.cache_length = 256  # L_cache of the overlong penalty
    c.reward.shaping.repetition_weight = 0.0  # weight of the repeated n-gram penalty
    c.reward.shaping.ngram_size = 4  # n of the repetition penalty
    c.reward.shaping.repetition_threshold = 0.0  # repetition ratio below this is free
    c.reward.rm_adjust = ml_collections.ConfigDict()
    c.reward.rm_adjust.tiered = True  # a verified-correct answer always outranks a wrong one
    # RM spread within a tier; None: half the bound (1/G) under which tiers cannot invert
    c.reward.rm_adjust.margin = ml_collections.config_dict.placeholder(float)
    c.reward.rm_adjust.dead_zone = 0.75  # BT-logit gaps below this tie (repro_inversion.py)
    c.reward.rm_adjust.rank = True  # rank-normalise RM scores within a tier
    c.reward.rm_adjust.squash_scale = 1.0  # scale of the squash before the margin

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
        c.rollout.update(max_new_tokens=32, max_chunk_size=8)
        c.reward.shaping.update(max_length=32, cache_length=8)
    return c
