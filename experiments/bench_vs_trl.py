"""One GRPO step of espo against Hugging Face TRL's `GRPOTrainer`, same model, data and work.

  python experiments/bench_vs_trl.py                          # 32 and 128 new tokens
  python experiments/bench_vs_trl.py --new_tokens 32 --steps 6
  python experiments/bench_vs_trl.py --trl_python none        # espo only

TRL lives in its own virtualenv, never in espo's dependencies:
  python -m venv .venv-trl && .venv-trl/bin/pip install trl==1.16.0 torch==2.13.0 \\
      transformers accelerate datasets
Without it (`--trl_python`, default .venv-trl/bin/python) the benchmark prints "TRL: ABSENT"
and times espo alone.

Both engines train the same random Qwen3-MoE checkpoint (configs/default.py's model: d128, 4
layers, 16 experts top-4, float32; the tiny byte-level BPE tokenizer of the tests, 320 ids, with
a Qwen chat template) on the same JSONL of additions, 16 prompts x 8 samples a step, temperature
1, one AdamW update over the 128 completions in micro-batches of 32, no KL term, no reference
model; the reward is the completion's length in characters / 10 (`espo.testing.length_reward`;
a random model solves no addition, and a reward that varies keeps every group in the loss). Both
sample from the same weights, so they generate the same number of tokens in expectation: the
mean completion length of each is printed. espo runs `configs/qwen3_moe.py` with FP8, adaptive G,
the pre-filter, reward shaping and IS correction off and `zve.mode=drop`, as TRL does none of
them, and `train.scan_layers=False` (an unrolled update: 4 layers compile in seconds). Each
engine runs in its own process, back to back; the step time is the median over steps
3..`--steps`, from espo's `perf/step_s` and a TRL callback around each optimizer step.

Other work on the two cores slows torch far more than JAX: time only on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROMPTS, GROUP, MICRO = 16, 8, 32  # prompts a step, samples a prompt, rows a micro-batch


def length_reward(completion: str) -> float:
    """The reward both engines use (espo.testing.length_reward, without its sleep)."""
    return len(completion) / 10.0


# ---------------------------------------------------------------- shared inputs (espo's venv)


def make_inputs(tmp: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """The random Qwen3-MoE checkpoint (with tokenizer files) and the JSONL of additions."""
    from espo import testing

    m = testing.load_script(ROOT / "configs" / "default.py").get_config("").model
    ckpt = testing.make_hf_checkpoint(
        tmp / "ckpt", vocab_size=320, hidden_size=m.d_model, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
        head_dim=m.head_dim, num_experts=m.num_experts, num_experts_per_tok=m.top_k,
        moe_intermediate_size=m.moe_ffn_dim, init_std=0.02, max_position_embeddings=1024,
    )  # fmt: skip
    testing.load_script(ROOT / "tests" / "data" / "conftest.py")._write_hf_tokenizer(ckpt)
    data = tmp / "additions.jsonl"
    rows = [
        {"prompt": f"What is {a} + {b}?", "answer": str(a + b)}
        for a in range(40)
        for b in range(40)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ckpt, data


# ---------------------------------------------------------------- espo (in its own process)


def espo_overrides(ckpt, data, *, steps: int) -> dict:
    return {
        "model.hf_path": str(ckpt), "data.path": str(data),
        "model.param_dtype": "float32", "model.dtype": "float32",
        "rollout.fp8": False, "rollout.temperature": 1.0,
        "train.steps": steps, "train.prompts_per_step": PROMPTS,
        "train.micro_batch_size": MICRO, "train.mini_batch_size": PROMPTS * GROUP,
        "optimizer.learning_rate": 1e-6, "optimizer.warmup_steps": 0,
        "optimizer.weight_decay": 0.0,
        "train.scan_layers": False,  # 4 layers: the unrolled update compiles in seconds
        "zve.mode": "drop", "zve.prefilter": "off", "zve.group_size": GROUP,
        "zve.max_group_size": GROUP, "loss.name": "grpo", "loss.rollout_is": "none",
        "reward.overlong_weight": 0.0, "reward.function": "espo.testing:length_reward",
        "eval.every_steps": 0, "eval.num_prompts": 4, "eval.sampled_prompts": 0,
        "checkpoint.every_steps": 10**6,
    }  # fmt: skip


def espo_worker(ckpt, data, *, new_tokens: int, steps: int, extra: dict) -> dict:
    sys.path.insert(0, str(ROOT / "experiments"))
    import repro_lib

    from espo import metrics, testing, trainer

    configs = testing.load_script(ROOT / "configs" / "qwen3_moe.py")
    cfg = configs.get_config("")
    repro_lib.set_fields(cfg, espo_overrides(ckpt, data, steps=steps))
    cfg.curriculum.stages = (
        configs.default.stage(
            "all", max_difficulty=1.0, steps=10**9, group_size=GROUP, max_new_tokens=new_tokens
        ),
    )
    repro_lib.set_fields(cfg, extra)
    with tempfile.TemporaryDirectory() as workdir:
        trainer.train(cfg, workdir, progress=False)
        rows = list(metrics.read_jsonl(pathlib.Path(workdir) / "metrics.jsonl"))
    timed = [r for r in rows if 3 <= r["step"] < steps]  # the last step also evaluates
    med = lambda key: statistics.median(r.get(key, 0.0) for r in timed)
    return {
        "step_s": med("perf/step_s"),
        "rollout_s": med("perf/rollout_s"),
        "old_logps_s": med("perf/old_logps_s"),
        "update_s": med("perf/update_s"),
        "generate_s": med("rollout/generate_s"),
        "host_handoff_s": med("rollout/host_handoff_s"),
        "reward_wait_s": med("rollout/reward_wait_s"),
        "mean_length": statistics.mean(r["rollout/mean_length"] for r in timed),
        "steps": [r["step"] for r in timed],
    }


# ---------------------------------------------------------------- TRL (in .venv-trl)


def trl_worker(ckpt, data, *, new_tokens: int, steps: int, extra: dict) -> dict:
    import datasets
    import torch
    import transformers
    import trl

    del extra
    torch.manual_seed(0)
    records = [json.loads(line) for line in pathlib.Path(data).read_text().splitlines()]
    dataset = datasets.Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r["prompt"]}]} for r in records]
    ).shuffle(seed=0)

    def reward(completions, **kw):
        return [length_reward(c[0]["content"] if isinstance(c, list) else c) for c in completions]

    times, lengths = [], []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    config = trl.GRPOConfig(
        output_dir=str(pathlib.Path(tempfile.mkdtemp()) / "trl"),
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=PROMPTS * GROUP // MICRO,
        num_generations=GROUP,
        max_completion_length=new_tokens,
        temperature=1.0,
        learning_rate=1e-6,
        warmup_steps=0,
        weight_decay=0.0,
        beta=0.0,
        loss_type="grpo",
        num_iterations=1,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=0,
        disable_tqdm=True,
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(ckpt)
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    trainer = trl.GRPOTrainer(
        model=model, reward_funcs=reward, args=config, train_dataset=dataset,
        processing_class=tokenizer, callbacks=[Clock()],
    )  # fmt: skip
    trainer.train()
    timed = times[2:-1]  # steps 3.. (1-based) but the last, as espo's
    return {
        "step_s": statistics.median(timed),
        "mean_length": statistics.mean(lengths[2:-1]) if lengths else float("nan"),
        "steps": list(range(3, len(times))),
    }


# ---------------------------------------------------------------- the update alone


def _micro_batch(vocab: int, new_tokens: int):
    """One micro-batch as the step trains it: MICRO rows of a 20-token prompt left-padded to
    32 and `new_tokens` completion tokens, random ids (the same for both engines)."""
    import numpy as np

    rng = np.random.default_rng(0)
    tokens = rng.integers(2, vocab, (MICRO, 32 + new_tokens))
    mask = np.ones(tokens.shape, bool)
    mask[:, :12] = False  # 20 real prompt tokens
    return tokens, mask


def _median_time(fn, repeats: int = 5) -> float:
    fn()  # compile / warm up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def espo_update_worker(ckpt, data, *, new_tokens: int, steps: int, extra: dict) -> dict:
    """Seconds of the forward and of the whole update (train_step: forward, backward, AdamW) of
    one micro-batch, router replay on, GRPO loss, jitted, median of 5 after a warm-up."""
    import functools

    import jax
    import numpy as np
    import optax

    from espo import advantages, batching, losses, model, train_step, types

    del data, steps
    cfg, params = model.load_hf_checkpoint(ckpt)
    tokens, mask = _micro_batch(cfg.vocab_size, new_tokens)
    free = model.forward(cfg, params, tokens, attention_mask=mask)
    ids = np.where(mask[:, None, :, None], np.asarray(free.router.expert_ids), -1)
    ids = ids.astype(types.expert_id_dtype(cfg.num_experts))
    trace = types.RouterTrace(expert_ids=ids, expert_weights=None)  # as the rollout records it
    loss_mask = mask.copy()
    loss_mask[:, :32] = False
    zeros = np.zeros(tokens.shape, np.float32)
    n = MICRO
    batch = batching.TrainBatch(
        tokens=tokens, attention_mask=mask, loss_mask=loss_mask, router=trace,
        sampler_logps=zeros, sampler_entropies=zeros, finished=np.ones(n, bool),
        group_ids=np.repeat(np.arange(n // GROUP), GROUP).astype(np.int32),
        rewards=np.random.default_rng(1).random(n).astype(np.float32),
        shaping=np.zeros(n, np.float32), valid=np.ones(n, bool), old_logps=zeros,
        old_entropies=zeros, ref_logps=zeros, advantages=np.ones(n, np.float32),
        zvp_sign=np.zeros(n, np.int32),
    )  # fmt: skip
    sc = train_step.StepConfig(
        model=cfg, loss=losses.LossConfig(name="grpo", vocab_size=cfg.vocab_size),
        advantage=advantages.AdvantageConfig(), entropy=train_step.EntropyConfig(),
        num_groups=n // GROUP, micro_batch_size=n, router_replay=True, fused_old_logps=True,
        scan_layers=extra.get("train.scan_layers", False),  # as the step runs it
    )  # fmt: skip
    opt = optax.adamw(1e-6)
    state = train_step.TrainState(
        step=np.zeros((), np.int32), params=params, opt_state=opt.init(params)
    )
    update = jax.jit(functools.partial(train_step.train_step, sc, opt))
    mini = batching.split(batch, 1)
    forward = jax.jit(
        lambda p: (
            train_step.token_logps(
                cfg, p, tokens, mask, routing=trace, routing_mode=train_step.RoutingMode.REPLAY_IDS
            ).logps
        )
    )
    return {
        "step_s": _median_time(lambda: jax.block_until_ready(update(state, mini))),
        "forward_s": _median_time(lambda: jax.block_until_ready(forward(params))),
    }


def torch_update_worker(ckpt, data, *, new_tokens: int, steps: int, extra: dict) -> dict:
    """The same in torch eager (TRL's update: forward, token log-probs, the GRPO surrogate with
    pi_old = this forward, backward, AdamW), and its forward under no_grad."""
    import torch
    import transformers

    del data, steps, extra
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    model.train()
    tokens, mask = _micro_batch(model.config.vocab_size, new_tokens)
    ids, att = torch.as_tensor(tokens), torch.as_tensor(mask.astype("int64"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    adv = torch.ones(MICRO, 1)

    def logps():
        logits = model(input_ids=ids, attention_mask=att).logits[:, 31:-1]
        return torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 32:, None])[..., 0]

    def step():
        lp = logps()
        loss = -(torch.exp(lp - lp.detach()) * adv).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

    def forward():
        with torch.no_grad():
            logps()

    return {"step_s": _median_time(step), "forward_s": _median_time(forward)}


WORKERS = {
    "espo": espo_worker, "trl": trl_worker,
    "espo_update": espo_update_worker, "torch_update": torch_update_worker,
}  # fmt: skip


# ---------------------------------------------------------------- driver


def run_worker(python, engine, ckpt, data, *, new_tokens, steps, extra) -> dict | None:
    argv = [str(python), __file__, "--worker", engine, "--ckpt", str(ckpt), "--data", str(data),
            "--new_tokens", str(new_tokens), "--steps", str(steps),
            "--extra", json.dumps(extra)]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"step_s"')]
    if proc.returncode != 0 or not lines:
        print(f"{engine} failed (exit {proc.returncode}): {proc.stderr[-3000:]}", file=sys.stderr)
        return None
    print(f"  {engine} {new_tokens} new tokens: {lines[-1]}", file=sys.stderr, flush=True)
    return json.loads(lines[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--new_tokens", default="32,128", help="comma-separated max_new_tokens")
    p.add_argument("--steps", type=int, default=8, help="RL steps per run (3..steps are timed)")
    p.add_argument("--trl_python", default=str(ROOT / ".venv-trl" / "bin" / "python"),
                   help="python of TRL's virtualenv; 'none': espo alone")  # fmt: skip
    p.add_argument("--espo", default="{}",
                   help="JSON {dotted key: value} espo overrides (the update table reads "
                   "train.scan_layers)")  # fmt: skip
    p.add_argument("--only", choices=("step", "update"), help="one table (default: both)")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--extra", default="{}", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        out = WORKERS[args.worker](
            args.ckpt, args.data, new_tokens=int(args.new_tokens), steps=args.steps + 1,
            extra=json.loads(args.extra),
        )  # fmt: skip
        print(json.dumps(out))
        return
    if args.steps < 4:
        sys.exit(f"--steps={args.steps} must be >= 4 (steps 3.. are timed)")
    trl_python = None if args.trl_python == "none" else pathlib.Path(args.trl_python)
    if trl_python is not None and not trl_python.exists():
        print(f"TRL: ABSENT ({trl_python} not found; see this script's docstring)")
        trl_python = None
    lengths = [int(x) for x in args.new_tokens.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt, data = make_inputs(pathlib.Path(tmp))
        if args.only != "update":
            step_table(args, ckpt, data, lengths, trl_python)
        if args.only != "step":
            update_table(ckpt, data, lengths, trl_python, extra=json.loads(args.espo))


def update_table(ckpt, data, lengths, trl_python, *, extra: dict) -> None:
    print(f"\nOne micro-batch of {MICRO} rows (32 + new tokens), seconds, median of 5:")
    print(
        "| new tokens | espo forward | torch forward | espo update | torch update | espo / torch |"
    )
    print("|---|---|---|---|---|---|")
    for n in lengths:
        kw = dict(new_tokens=n, steps=0, extra={})
        e = run_worker(sys.executable, "espo_update", ckpt, data, **{**kw, "extra": extra})
        t = run_worker(trl_python, "torch_update", ckpt, data, **kw) if trl_python else None
        if e is None:
            continue
        tf, tu = (f"{t['forward_s']:.3f}", f"{t['step_s']:.3f}") if t else ("absent", "absent")
        ratio = f"**{e['step_s'] / t['step_s']:.2f}x**" if t else "-"
        print(f"| {n} | {e['forward_s']:.3f} | {tf} | {e['step_s']:.3f} | {tu} | {ratio} |")


def step_table(args, ckpt, data, lengths, trl_python) -> None:
    print("| new tokens | espo s/step | TRL s/step | espo / TRL | espo rollout / old log-probs / "
          "update s | mean length espo / TRL |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for n in lengths:
        kw = dict(new_tokens=n, steps=args.steps, extra=json.loads(args.espo))
        e = run_worker(sys.executable, "espo", ckpt, data, **kw)
        t = run_worker(trl_python, "trl", ckpt, data, **kw) if trl_python else None
        if e is None:
            continue
        trl_s = f"{t['step_s']:.2f}" if t else "absent"
        ratio = f"**{e['step_s'] / t['step_s']:.2f}x**" if t else "-"
        phases = f"{e['rollout_s']:.2f} / {e['old_logps_s']:.2f} / {e['update_s']:.2f}"
        mean_len = f"{e['mean_length']:.1f} / {t['mean_length']:.1f}" if t else "-"
        print(f"| {n} | {e['step_s']:.2f} | {trl_s} | {ratio} | {phases} | {mean_len} |",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
