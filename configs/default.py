"""The embedded default: RL that fixes a flawed teacher's bug, on a small MoE from scratch.

Run:  make run   (= python experiments/run.py --config configs/default.py)
      python experiments/run.py --config configs/default.py:tiny --workdir /tmp/espo_tiny
      python experiments/run.py --config configs/default.py --config.loss.name=grpo

`get_config(arg)` takes a variant: "" (default), "tiny" (the smallest shapes; the tests run it) or
"qwen3_shape" (the same job on a 4-layer MoE of Qwen3-30B-A3B's widths, 128 experts top-8,
random weights, bf16: `experiments/bench_train.py --configs default:qwen3_shape` on a GPU).
The task (`espo.data.chains`): + / - chains of 3 to 6 one-digit terms (heavy-tailed lengths),
worked one reduction a line. The supervised warm start (`sft`) learns from a teacher with one
systematic flaw (it drops the minus sign of a negative answer with probability
`data.teacher_error`), so it converges to the teacher's bug; RL with the verifier's reward then
trains the whole "Each Prompt Matters" pipeline against it: curriculum -> pre-filter -> adaptive
G -> FP8 rollout with length-aware scheduling and overlapped rewards -> shaping -> zero-variance
elimination -> advantages -> old log-probs with router replay -> ESPO updates -> eval ->
checkpoint. The held-out test set depends on `data.seed` only, never on `seed`.

Library modules never read this ConfigDict: `espo.config.Settings.from_config` turns each section
into the frozen, validated dataclass of the module that owns it, before anything compiles.

Expected result (`make run`, 2 idle cores, 529-546 s of `trainer.train`; README "What make run
shows", docs/make_run/results.md): held-out greedy pass@1 on the 1024 test prompts from the warm
start's 0.648 to 0.873 after 30 RL steps, a change of +0.225 ± 0.084 [0.141, 0.309] (mean and
95% Student-t interval over seeds 0, 1, 2: 0.657 -> 0.880, 0.665 -> 0.925, 0.623 -> 0.815),
process fidelity 0.872. The warm start's recipe run for twice the steps (840 SFT steps, no RL)
gains +0.021 ± 0.021.
"""

import ml_collections
from ml_collections import config_dict

# Where this config departs from the library's defaults (the dataclass each section becomes) and
# why; every other value is the library's own (tests/test_configs.py checks both ways).
DEVIATIONS = {
    "model.qk_norm": "Qwen3-style q/k norm (the dataclass default is Mixtral's False)",
    "model.aux_loss_coef": "a little load balancing for 16 experts trained from scratch",
    "data.source": "the embedded chains task (the dataclass default is reasoning_gym)",
    "data.tasks": "chains has no reasoning_gym task specs",
    "data.size": "30,000 chains: no prompt repeats in make run's 30 steps",
    "data.max_terms": "3-6 terms: heavy-tailed lengths the warm start still learns in 420 steps",
    "data.terms_decay": "the length tail of the testbed (docs/testbed/README.md)",
    "rollout.max_chunk_size": "128 rows decoded together: one chunk per step on 2 cores",
    "train.packing": "packed updates: about half the positions of padded rows",
    "train.max_tokens_per_micro_batch": "2048 tokens: the fastest packed micro-batch measured",
    "optimizer.warmup_steps": "10 of 30 RL steps",
    "optimizer.b2": "0.99: Adam's second moment tracks the short RL run",
    "sft.steps": "the warm start near its plateau (docs/testbed/README.md)",
    "sft.learning_rate": "4e-3: the fastest warm start that stays stable at this size",
    "sft.warmup_steps": "20 of 420 steps",
    "sft.packing": "packed demonstrations: about half the positions",
    "eval.every_steps": "at the start, half way (step 15) and the end",
    "eval.num_prompts": "1024 test prompts: a 95% interval of about +-3 points",
    "eval.sampled_prompts": "avg@k / pass@k on the first 64 prompts (greedy pass@1 on all)",
    "eval.batch_size": "256 rows a sampler call (fewer, larger calls)",
    "checkpoint.every_steps": "twice in a 30-step run",
    "advantage.success_threshold": "0.5: a 0 / 1 verifier reward less a shaping penalty",
    "zve.prefilter_low": "never-solved prompts: pass rate <= 0.05 (not only exactly 0)",
    "zve.prefilter_high": "always-solved prompts: pass rate >= 0.95 (not only exactly 1)",
    "zve.max_group_size": "adaptive G up to 16 for prompts near 0 or 1",
    "reward.overlong_weight": "a half-weight DAPO overlong penalty",
    "reward.overlong_cache_fraction": "the soft zone: the last 20% of the budget",
    "train.scan_layers": "4 layers: the unrolled update is ~15% faster and compiles in seconds",
}

_float = config_dict.placeholder(float)  # "None: the library's default for this setting"
_int = config_dict.placeholder(int)


def stage(name, *, max_difficulty, steps, group_size=8, max_new_tokens=8, **kw):
    """One curriculum stage (espo.curriculum.Stage fields)."""
    return ml_collections.ConfigDict(
        dict(
            name=name,
            min_difficulty=kw.get("min_difficulty", 0.0),  # easiest level drawn
            max_difficulty=max_difficulty,  # hardest level drawn
            group_size=group_size,  # G of the stage (adaptive G may raise it)
            max_new_tokens=max_new_tokens,  # generation budget of the stage
            advance=kw.get("advance", "steps"),  # "steps" or "accuracy"
            steps=steps,  # steps in the stage (a cap with "accuracy")
            accuracy_threshold=kw.get("accuracy_threshold", 0.8),  # "accuracy": EMA to advance
        )
    )


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    variant = arg or "default"
    if variant not in ("default", "tiny", "qwen3_shape"):
        raise ValueError(
            f"configs/default.py: variant {variant!r} is invalid; valid: default, tiny, qwen3_shape"
        )
    c = ml_collections.ConfigDict()
    c.seed = 0  # PRNG seed of init, data order, sampling and evaluation
    c.workdir = "runs/default"  # outputs: checkpoints, metrics.jsonl, tensorboard, plots, export

    # ---- model: espo.model.ModelConfig fields, or a Hugging Face checkpoint directory ------------
    c.model = ml_collections.ConfigDict()
    c.model.hf_path = ""  # local Qwen3-MoE / Mixtral dir (+ tokenizer files); overrides the rest
    c.model.init_from = ""  # an espo workdir: start from its newest checkpoint's params (no sft)
    c.model.vocab_size = 128  # V (the character tokenizer uses 98 ids)
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
    c.model.rms_eps = 1e-6  # epsilon of every RMSNorm
    c.model.dense_layers = ()  # layers with a dense SwiGLU MLP instead of a MoE block
    c.model.dense_ffn_dim = 0  # hidden width of that dense MLP
    c.model.shared_expert_ffn_dim = 0  # an always-on shared expert's width; 0 = none
    c.model.shared_expert_gate = True  # sigmoid gate on the shared expert (Qwen2-MoE)
    c.model.tie_embeddings = False  # output projection shares the input embedding
    c.model.sliding_window = _int  # attend to at most this many previous positions; None = all
    c.model.param_dtype = "float32"  # parameter storage dtype
    c.model.dtype = "float32"  # activation / matmul dtype
    c.model.aux_loss_coef = 0.001  # load-balancing loss weight (added to the policy loss)
    c.model.z_loss_coef = 0.0  # router z-loss weight
    # How long rows are computed (values unchanged; docs/performance.md "Long traces"):
    c.model.attention_impl = "auto"  # auto | dense | blocked | triton | splash (model/attention.py)
    c.model.moe_impl = "auto"  # auto | capacity | ragged | mosaic_gpu | ... (model/experts.py)
    c.model.remat = "none"  # none | full | dots_with_no_batch_dims_saveable: per-layer remat
    # (on CPU its memory saving needs train.scan_layers = True: transformer.remat_block)
    c.model.logits_chunk = 0  # tokens per chunk of the head's log-probs; 0: sized from V
    c.model.moe_chunk = 0  # tokens of each row per chunk of the MoE dispatch; 0: whole rows

    # ---- data: espo.data.DataConfig (grain pipeline) ---------------------------------------------
    c.data = ml_collections.ConfigDict()
    c.data.source = "chains"  # chains | reasoning_gym | jsonl | parquet | tfds
    c.data.seed = 0  # seed of the generated examples (and so of the held-out set)
    c.data.size = 30000  # chains / reasoning_gym: examples generated (per task spec)
    c.data.min_terms = 3  # chains: shortest chain
    c.data.max_terms = 6  # chains: longest chain (about 55 characters worked)
    c.data.terms_decay = 0.75  # chains: P(n terms) ~ terms_decay ** n (heavy-tailed lengths)
    c.data.teacher_flaw = "final_sign"  # chains: the teacher's flaw: none | final_sign | sign
    c.data.teacher_error = 0.7  # chains: probability of the flaw where it can occur
    c.data.tasks = ""  # reasoning_gym task specs "name:key=value...:difficulty=x;..."
    c.data.path = ""  # jsonl / parquet file, or the TFDS dataset name
    c.data.tfds_data_dir = ""  # TFDS data_dir (prepared ArrayRecord files)
    c.data.split = "train"  # TFDS split
    c.data.prompt_field = "prompt"  # record field with the question
    c.data.answer_field = "answer"  # record field with the gold answer
    c.data.difficulty_field = ""  # optional record field with a difficulty in [0, 1]
    c.data.eval_path = ""  # separate held-out file; "" = split by eval_fraction
    c.data.eval_fraction = 0.1  # held-out share (by a stable hash of the prompt text)
    c.data.train_max_samples = 0  # the training pool: its first this many examples (0: all)
    c.data.skip_bad_records = False  # True: skip and count malformed records instead of failing
    c.data.worked_solutions = False  # reasoning_gym + / -: binary steps a line (configs/arithmetic)
    c.data.max_prompt_length = 48  # prompts longer than this (tokens) are skipped (verl's filter)

    # ---- rollout: sampling (names as in vLLM / verl) and scheduling ------------------------------
    c.rollout = ml_collections.ConfigDict()
    # At 1.0 a negative answer keeps its minus sign in about the teacher's 30% of the samples,
    # which is the signal RL amplifies (greedy decoding drops it every time after the warm start).
    c.rollout.temperature = 1.0  # sampling temperature (0 = greedy); the update scales the same
    c.rollout.top_p = 1.0  # nucleus mass kept
    c.rollout.top_k = 0  # 0 = no top-k truncation
    c.rollout.fp8 = True  # sample from FP8 (e4m3) weights; training stays in param_dtype
    c.rollout.dtype = ""  # sampler activation dtype (float32 | bfloat16); "" = model.dtype
    c.rollout.max_chunk_size = 128  # rows decoded together
    # experts: the sampler's weights with experts over the expert axis, the rest replicated
    # (no weight gathered at a decode step; converted once a step)
    c.rollout.param_layout = "training"  # sampler weights on a mesh: training|experts|experts_all
    c.rollout.offload_state = False  # training state in host memory while the rollout decodes
    c.rollout.schedule = "length_aware"  # length_aware | fifo
    c.rollout.prefill_cost = 1.0  # a re-prefilled position in decode slot-steps (CPU ~1)
    c.rollout.steps_per_check = 1  # decode steps between loop-condition checks (GPU: more)
    c.rollout.overlap_rewards = True  # score samples while later chunks decode (False: after)
    c.rollout.detokenize = "workers"  # workers (parallel, in the reward pool) | host (serial)
    c.rollout.reward_workers = 2  # reward process pool size
    c.rollout.reward_timeout_s = 10.0  # per-sample reward timeout

    # ---- train: the RL loop (verl / TRL names) ---------------------------------------------------
    c.train = ml_collections.ConfigDict()
    c.train.steps = 30  # RL steps
    c.train.prompts_per_step = 16  # groups per optimiser batch (verl: train_batch_size)
    c.train.ppo_epochs = 1  # passes over each batch (verl: ppo_epochs, TRL: num_iterations)
    c.train.mini_batch_size = 0  # rows per optimiser update; 0 = the whole batch (one update)
    c.train.micro_batch_size = 64  # rows per forward/backward (exact accumulation)
    c.train.packing = True  # pack whole sequences into micro-batches, not padded rows
    c.train.max_tokens_per_micro_batch = 2048  # tokens per packed micro-batch (docs/performance.md)
    c.train.router_replay = True  # replay the rollout's experts in old-log-prob and update forwards
    c.train.replay_counterfactual = False  # also pi_old under the other routing (diagnostic)
    c.train.scan_layers = False  # True: scan over layers (compile time flat in depth; slower here)
    c.train.old_logps = "recompute"  # recompute (trainer params) | sampler (the rollout's)
    c.train.espo_entropy = "old"  # ESPO grouping entropies: old | sampler
    c.train.rl_zvp_entropy = "current"  # RL-ZVP entropies: current | old | sampler
    c.train.log_every = 1  # steps between metrics.jsonl lines

    # ---- optimizer: optax AdamW, warmup + cosine, global-norm clipping ---------------------------
    c.optimizer = ml_collections.ConfigDict()
    c.optimizer.learning_rate = 5e-5  # peak learning rate (2e-4 degrades the warm start)
    c.optimizer.warmup_steps = 10  # linear warmup
    c.optimizer.schedule = "cosine"  # cosine | constant (after warmup)
    c.optimizer.end_lr_ratio = 0.1  # cosine floor as a fraction of the peak
    c.optimizer.weight_decay = 0.0  # AdamW decoupled weight decay
    c.optimizer.b1 = 0.9  # Adam beta1
    c.optimizer.b2 = 0.99  # Adam beta2
    c.optimizer.eps = 1e-8  # Adam epsilon
    c.optimizer.max_grad_norm = 1.0  # global-norm clip (0 = off)

    # ---- sft: supervised warm start on task demonstrations (skipped from a checkpoint) -----------
    c.sft = ml_collections.ConfigDict()
    c.sft.steps = 420  # 0 = no warm start (near its plateau: docs/testbed/README.md)
    c.sft.batch_size = 64  # demonstrations per step
    c.sft.learning_rate = 4e-3  # AdamW peak (warmup + cosine)
    c.sft.warmup_steps = 20  # linear warmup
    c.sft.packing = True  # demonstrations end to end in the rows (~half the positions computed)
    c.sft.verified_only = False  # only demonstrations the verifier accepts (offline filtering)

    # ---- curriculum: espo.curriculum stages, in order (Compass-Thinker-7B) -----------------------
    c.curriculum = ml_collections.ConfigDict()
    # Budgets: the longest worked solution of a stage (3-4 terms: 29 characters, 3-6 terms: 49, +
    # the stop id) stays below the overlong penalty's onset, max_new_tokens * (1 -
    # reward.overlong_cache_fraction).
    c.curriculum.stages = (
        stage("short", max_difficulty=1 / 3, steps=15, max_new_tokens=48),
        stage("all", max_difficulty=1.0, steps=10**9, max_new_tokens=72),
    )

    # ---- eval: held-out greedy pass@1 and avg@k / pass@k -----------------------------------------
    c.eval = ml_collections.ConfigDict()
    c.eval.every_steps = 15  # 0 = only at the start and the end
    c.eval.samples = 8  # k of avg@k / pass@k
    c.eval.num_prompts = 1024  # held-out prompts of eval.split evaluated (greedy pass@1)
    c.eval.sampled_prompts = 64  # of them, the first this many also sampled (avg@k, pass@k, maj@k)
    c.eval.split = "test"  # test (report) | dev (tune): held-out halves (eval_path: all test)
    c.eval.min_difficulty = 0.0  # held-out prompts of at least this level only (0: all)
    c.eval.temperature = 1.0  # of the k samples (pass@1 is greedy)
    c.eval.batch_size = 256  # rows per sampler call

    # ---- checkpoint: orbax CheckpointManager in WORKDIR/checkpoints ------------------------------
    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every_steps = 15  # save period (and always at the end)
    c.checkpoint.keep = 2  # newest checkpoints kept

    # ---- loss: espo.losses.LossConfig ------------------------------------------------------------
    c.loss = ml_collections.ConfigDict()
    c.loss.name = "espo"  # grpo | gspo | espo | cispo
    c.loss.agg = config_dict.placeholder(str)  # aggregation; None = the loss's default
    c.loss.clip_low = _float  # None = the loss's default (grpo 0.2, gspo 3e-4)
    c.loss.clip_high = _float  # None = the loss's default (grpo 0.2, gspo 4e-4)
    c.loss.dual_clip = _float  # dual-clip constant for A < 0 (e.g. 3.0); None = off
    c.loss.norm_length = _int  # seq-mean-token-sum-norm divisor; None = T
    c.loss.top_frac = 0.2  # ESPO: share of tokens in the high-entropy group
    c.loss.num_entropy_groups = 2  # ESPO: entropy groups per sequence
    c.loss.quantile_scope = "sequence"  # ESPO: entropy quantiles per sequence or per batch
    c.loss.alpha = 0.02  # ESPO: eps = alpha * mean group entropy / log|V|
    c.loss.espo_ratio = "gspo_token"  # ESPO ratio reading: gspo_token | literal (Eq. 9)
    c.loss.kl_coef = 0.0  # beta of the KL to the reference (warm-start) policy; 0 = none
    c.loss.kl_estimator = "k3"  # k1 | k2 | k3
    c.loss.overlong_filter = False  # DAPO: truncated samples (no EOS) leave the loss
    c.loss.rollout_is = "none"  # IS weight pi_old / pi_sampler: none | token | sequence (geo mean)
    c.loss.rollout_is_cap = 2.0  # truncated IS: weight = min(weight, cap) (verl TIS)
    c.loss.rollout_rs = "none"  # reject tokens / sequences: none | token | sequence | icepop
    c.loss.rollout_rs_low = _float  # reject ratios below; None = the mode's (0.5)
    c.loss.rollout_rs_high = _float  # reject ratios above; None = the mode's (2; icepop 5)

    # ---- advantage: espo.advantages.AdvantageConfig ----------------------------------------------
    c.advantage = ml_collections.ConfigDict()
    c.advantage.estimator = "grpo"  # grpo: (r - mean) / (std + eps) | dr_grpo: r - mean | rft
    c.advantage.eps = 1e-6  # added to the group std
    c.advantage.rl_zvp_alpha = 0.1  # RL-ZVP alpha (used when zve.mode = rl_zvp)
    c.advantage.success_threshold = 0.5  # a sample is correct when its verifier reward > this

    # ---- zve: espo.zero_variance.ZveConfig (multi-stage zero-variance elimination) ---------------
    c.zve = ml_collections.ConfigDict()
    c.zve.mode = "rl_zvp"  # optimiser stage: resample | rl_zvp | drop
    c.zve.max_resample_rounds = 4  # resample: extra generation rounds at most
    c.zve.oversample = 1.0  # resample: min prompts drawn per missing group
    c.zve.max_oversample = 4.0  # resample: max prompts drawn per missing group
    c.zve.max_carry_over_steps = 0  # resample: steps a leftover group is kept (0: none, as DAPO)
    c.zve.atol = 1e-6  # rewards closer than this count as equal
    c.zve.prefilter = "drop"  # pass-rate pre-filter on the online history: drop | downweight | off
    c.zve.prefilter_low = 0.05  # pass rate <= this is filtered (never solved)
    c.zve.prefilter_high = 0.95  # pass rate >= this is filtered (always solved)
    c.zve.prefilter_downweight = 0.1  # sampling weight of filtered prompts in downweight mode
    c.zve.pass_rate_table = ""  # offline pass rates seeding the history (espo.pass_rates)
    c.zve.group_size = 8  # G for prompts with no history (a stage's group_size overrides it)
    c.zve.max_group_size = 16  # adaptive G up to this (== group_size: adaptive G off)
    c.zve.zvp_target = 0.5  # adaptive G: smallest G with p^G + (1-p)^G below this
    c.zve.rollout_budget = _int  # cap on the sum of G per step; None = no cap

    # ---- reward: shaping (espo.rewards.shaping); L_max is the stage's max_new_tokens -------------
    c.reward = ml_collections.ConfigDict()
    c.reward.overlong_weight = 0.5  # weight of the DAPO soft overlong penalty
    c.reward.overlong_cache_fraction = 0.2  # L_cache as a fraction of max_new_tokens (DAPO: 0.2)
    c.reward.repetition_weight = 0.0  # weight of the repeated n-gram penalty
    c.reward.ngram_size = 4  # n of the repetition penalty
    c.reward.repetition_threshold = 0.0  # repetition ratio below this is free
    c.reward.function = ""  # "module:name" of your fn(prompt, completion, meta) -> float
    # A learned reward model (espo.rewards.model_rewards: a saved Bradley–Terry RM) scoring every
    # rollout; the verifier still measures the run (accuracy, evals) and the rm/* inversion rates.
    c.reward.model_path = ""  # directory of a saved RM ("" = rewards from the verifier only)
    c.reward.model_mode = "adjusted"  # naive (RM score) | adjusted (tiers, ties, ranks) | judge
    c.reward.model_dead_zone = 0.75  # RM score gaps below this are ties (adjusted, judge)
    c.reward.shuffle = False  # a control: rewards permuted over each rollout call's rows

    # ---- mesh: espo.sharding (data x fsdp x expert = the device count) ---------------------------
    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1  # data-parallel shards of the batch; -1 = the devices the others leave
    c.mesh.fsdp = 1  # parameters / optimizer state sharded along the model dimension (ZeRO-3)
    c.mesh.expert = 1  # expert parallelism: num_experts / expert experts per device (all-to-all)

    # ---- distributed: jax.distributed.initialize (docs/usage.md "Scale-out") ---------------------
    c.distributed = ml_collections.ConfigDict()
    c.distributed.coordinator = ""  # host:port of process 0; "" = one process (or the env's)
    c.distributed.num_processes = 1  # processes in the run
    c.distributed.process_id = 0  # this process's index

    if variant == "qwen3_shape":  # Qwen3-30B-A3B's config.json widths, 4 of its 48 layers
        c.model.update(d_model=2048, num_layers=4, num_heads=32, num_kv_heads=4, head_dim=128)
        c.model.update(num_experts=128, top_k=8, moe_ffn_dim=768, rope_theta=1e6)
        c.model.update(param_dtype="bfloat16", dtype="bfloat16")
    if variant == "tiny":
        c.model.update(d_model=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16)
        c.model.update(num_experts=4, top_k=2, moe_ffn_dim=32)
        c.data.update(size=64, eval_fraction=0.25, max_terms=4, max_prompt_length=32)
        c.rollout.update(max_chunk_size=16, reward_workers=1)
        c.train.update(steps=2, prompts_per_step=2, micro_batch_size=8, mini_batch_size=16)
        c.sft.update(steps=2, batch_size=4, learning_rate=2e-3)
        # Padded rows: fewer compiled shapes in the many short test runs (packing has its own
        # tests: tests/test_packed_update.py, tests/test_sft.py).
        c.train.packing = False
        c.sft.packing = False
        c.curriculum.stages = (
            stage("short", max_difficulty=0.5, steps=1, group_size=4, max_new_tokens=16),
            stage("all", max_difficulty=1.0, steps=10**9, group_size=4, max_new_tokens=16),
        )
        c.zve.update(group_size=4, max_group_size=8)
        c.eval.update(every_steps=0, samples=2, num_prompts=4, batch_size=8)
        c.checkpoint.update(every_steps=1)
    return c
