"""RL of a Hugging Face Qwen3-MoE / Mixtral checkpoint on a JSONL / Parquet math set.

Run:  python experiments/run.py --config configs/qwen3_moe.py \\
          --config.model.hf_path=/ckpt/Qwen3-30B-A3B --config.data.path=/data/math.jsonl

`model.hf_path` is a local checkpoint directory: config.json, *.safetensors, tokenizer.json,
tokenizer_config.json (with the chat template) and generation_config.json (its stop ids). The
answers are checked with math-verify (`espo.rewards.math.MathReward`). The trained policy is
exported in Hugging Face format to WORKDIR/export at the end. Variants: "", "long" (reasoning-
length traces: prompts up to 2k tokens, up to 30,720 new ones, packed into 32k-token
micro-batches, every layer rematerialised, the MoE dispatch 4k tokens at a time; the update's
gradient of one 32k trace on the 48-layer Qwen3-30B-A3B needs 12.6 GiB of temporaries on an H200
without MoE chunks, 11.7 GiB compiled for a TPU v5p chip with them, docs/performance.md) and "tiny"
(the tests run it on a random tiny checkpoint they build); and the real-size presets
"30b_a3b" (Qwen3-30B-A3B at NeMo-RL's GRPO shape: 4k tokens, 2,048 rows a step), "30b_a3b_long"
(the same at 2k + 30k tokens), "30b_a3b_long_h100" (that on 8 x 80 GB: 128-row rollout
chunks, the training state in host memory while they decode) and "235b_a22b" (Qwen3-235B-A22B
at 8k tokens), whose RL step `experiments/aot.py` compiles for a TPU slice or a GPU node
without weights (PRESETS below; docs/performance.md "Does it fit").

Expected result: none measured yet. No real checkpoint has been trained with this config (the
documentation reports no such run); the tests check only that the tiny variant trains and exports.
"""

import importlib.util
import pathlib

import ml_collections

# The default config file, loaded by path (config files are loaded by path, not as a package).
_spec = importlib.util.spec_from_file_location(
    "espo_configs_default", pathlib.Path(__file__).with_name("default.py")
)
default = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(default)


# Real shapes, no weights needed (`experiments/aot.py` compiles their RL step for a TPU slice or
# a GPU node; a run reads the weights from model.hf_path, whose config.json must match):
# architecture (config.json), RL batch and lengths as NeMo-RL's GRPO performance recipes
# (G-GBS rows a step, T-GBS rows an update), and the mesh the aot tool found to fit.
PRESETS = {
    # Qwen3-30B-A3B at NeMo-RL's shape: 4k tokens, 64 prompts x 32 = 2,048 rows, 512 an update
    # (layout: the rollout's weights, rollout.param_layout: experts over `expert`, the rest
    # replicated; 235B's experts over `expert` alone would not fit, so they split over every
    # axis there: "experts_all")
    "30b_a3b": dict(model="qwen3_30b_a3b", prompt=1024, new=3072, prompts=64, group=32,
                    mini=512, budget=8192, mesh=dict(data=1, fsdp=1, expert=8), layout="experts"),
    # the same at reasoning length: 2k + 30k tokens (the "long" settings)
    "30b_a3b_long": dict(model="qwen3_30b_a3b", prompt=2048, new=30720, prompts=32, group=16,
                         mini=128, budget=32768, mesh=dict(data=1, fsdp=1, expert=8),
                         layout="experts"),
    # the same on 8 GPUs of 80 GB: a 32k row's bf16 KV cache is 3.2 GB, so 16 rows a GPU (one
    # prompt's group) and the training state in host memory while they decode (offload); the
    # eval (bf16 weights, the params resident) decodes 8 rows a GPU
    "30b_a3b_long_h100": dict(model="qwen3_30b_a3b", prompt=2048, new=30720, prompts=32,
                              group=16, mini=128, budget=32768,
                              mesh=dict(data=1, fsdp=1, expert=8), layout="experts", chunk=128,
                              offload=True, eval_rows=64),
    # Qwen3-235B-A22B at NeMo-RL's shape: 8k tokens, 32 prompts x 16 = 512 rows a step
    "235b_a22b": dict(model="qwen3_235b_a22b", prompt=1024, new=7168, prompts=32, group=16,
                      mini=512, budget=8192, mesh=dict(data=1, fsdp=8, expert=8),
                      layout="experts_all"),
}  # fmt: skip


def preset(c: ml_collections.ConfigDict, name: str) -> None:
    """`c` set to preset `name`'s architecture, batch, lengths and mesh (PRESETS)."""
    import dataclasses

    from espo.model import config as model_config

    p = PRESETS[name]
    arch = dataclasses.asdict(getattr(model_config.ModelConfig, p["model"])())
    compute = {f: c.model[f] for f in model_config.COMPUTE_FIELDS if f in c.model}
    c.model.update({**arch, **compute, "hf_path": c.model.hf_path})
    c.data.max_prompt_length = p["prompt"]  # tokens of a prompt at most
    c.curriculum.stages = (  # one stage: the recipe's G and generation budget
        default.stage("all", max_difficulty=1.0, steps=10**9, group_size=p["group"],
                      max_new_tokens=p["new"]),
    )  # fmt: skip
    c.zve.group_size = c.zve.max_group_size = p["group"]  # adaptive G off: the recipe's G
    rows = p["prompts"] * p["group"]
    c.train.update(prompts_per_step=p["prompts"], mini_batch_size=min(p["mini"], rows))
    c.train.update(packing=True, max_tokens_per_micro_batch=p["budget"])
    c.model.remat = "full"  # each layer's input kept, the rest recomputed
    c.model.moe_chunk = 4096  # the MoE's (token, expert) buffers 4k tokens at a time
    c.rollout.max_chunk_size = p.get("chunk", 256)  # rows decoded together
    c.rollout.offload_state = p.get("offload", False)  # training state in host memory meanwhile
    c.eval.batch_size = p.get("eval_rows", c.eval.batch_size)  # rows an eval call decodes
    c.rollout.param_layout = p["layout"]  # the sampler's weights: experts | experts_all
    c.mesh.update(p["mesh"])


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    variant = arg or "default"
    if variant not in ("default", "long", "tiny", *PRESETS):
        raise ValueError(
            f"configs/qwen3_moe.py: variant {variant!r} is invalid; valid: default, long, tiny, "
            + ", ".join(PRESETS)
        )
    c = default.get_config("tiny" if variant == "tiny" else "default")
    c.workdir = "runs/qwen3_moe"  # outputs of the run
    c.model.hf_path = "/path/to/qwen3_moe"  # the checkpoint directory (required)
    c.model.param_dtype = "bfloat16"  # as the checkpoints ship
    c.model.dtype = "bfloat16"  # activations / matmuls
    c.data.source = "jsonl"  # jsonl | parquet | tfds
    c.data.path = "/path/to/math.jsonl"  # records with `prompt` and `answer` fields
    c.data.worked_solutions = False  # the default's procedural demonstrations: not for files
    c.data.max_prompt_length = 512  # tokens; longer prompts are skipped
    c.sft.steps = 0  # a pretrained checkpoint needs no warm start
    c.rollout.temperature = 1.0  # Qwen3 thinking mode samples at T = 0.6-1.0
    c.train.update(steps=200, prompts_per_step=32, micro_batch_size=8, mini_batch_size=128)
    c.train.scan_layers = True  # 48-layer checkpoints: an unrolled update compiles for minutes
    c.train.packing = False  # True: pack responses (lengths vary ~10x) instead of padding them
    c.train.max_tokens_per_micro_batch = 8192  # >= max_prompt_length + max_new_tokens (2560)
    c.optimizer.update(learning_rate=1e-6, warmup_steps=10, weight_decay=0.01)
    c.reward.overlong_cache_fraction = 0.25  # DAPO: L_cache = L_max / 4
    c.loss.rollout_is = "token"  # TIS on the FP8 rollout's log-probs, on top of router replay
    c.curriculum.stages = (
        default.stage("all", max_difficulty=1.0, steps=10**9, max_new_tokens=2048),
    )
    c.eval.update(every_steps=50, num_prompts=128, samples=4)
    if variant == "long" or variant.startswith("30b_a3b_long"):  # 2k + 30k-token traces
        c.data.max_prompt_length = 2048  # tokens: a long problem statement fits
        c.model.remat = "full"  # each layer's input kept, the rest recomputed (least memory)
        c.model.moe_chunk = 4096  # the MoE's (token, expert) buffers 4k tokens of a row at a time
        c.train.packing = True  # lengths vary ~10x: pack them, micro-batches by token budget
        c.train.max_tokens_per_micro_batch = 32768  # one whole trace (2048 + 30720) fits
        c.curriculum.stages = (
            default.stage("all", max_difficulty=1.0, steps=10**9, max_new_tokens=30720),
        )
    if variant in PRESETS:
        preset(c, variant)
    if variant == "tiny":
        c.model.update(param_dtype="float32", dtype="float32")
        c.data.max_prompt_length = 48
        c.train.update(steps=2, prompts_per_step=2, micro_batch_size=8, mini_batch_size=16)
        c.optimizer.learning_rate = 1e-4
        c.curriculum.stages = (
            default.stage("all", max_difficulty=1.0, steps=10**9, group_size=4, max_new_tokens=8),
        )
        c.eval.update(every_steps=0, num_prompts=4, samples=2, batch_size=8)
    return c
