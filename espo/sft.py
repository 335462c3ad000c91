"""The supervised warm start: token NLL of task demonstrations (prompt -> answer + stop id).

A policy trained from scratch never succeeds, so RL would see only zero-variance groups; a short
supervised phase on the demonstrations (the gold answers, in the format the verifier reads) gives
it a non-zero pass rate. The loss is the mean NLL of the completion tokens (the prompt is
context only), from `espo.train_step.token_logps` like every other log-prob.

`packed_batch` lays the demonstrations end to end (`espo.packing`, first-fit decreasing) in
rows as long as the padded batch's, the row count rounded up to a multiple of `ROW_MULTIPLE` (a
few compiled shapes per run): each token sees only its own demonstration (segment ids,
positions restarting at 0), so the loss equals the padded batch's while the forward computes
~half the positions on the default task mix.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from espo import errors, packing, sampler, train_step
from espo.model import config as config_lib

ROW_MULTIPLE = 8  # packed SFT batches have a multiple of this many rows


@dataclasses.dataclass(frozen=True, kw_only=True)
class SftConfig:
    """The supervised warm start: token NLL on task demonstrations."""

    steps: int = 0
    batch_size: int = 64
    learning_rate: float = 1e-3
    warmup_steps: int = 0
    packing: bool = False  # demonstrations packed end to end (espo.sft.packed_batch)
    # Offline filtering: train only on the demonstrations the task's verifier (the reward RL
    # scores rollouts with) accepts, reward > advantage.success_threshold (what "rft" counts as
    # correct); the others are drawn and skipped. Zero rollouts.
    verified_only: bool = False

    def __post_init__(self):
        errors.check(
            self,
            {
                "steps": (errors.is_int(self.steps) and self.steps >= 0, "an int >= 0"),
                "packing": (isinstance(self.packing, bool), "True or False"),
                "verified_only": (isinstance(self.verified_only, bool), "True or False"),
                "batch_size": (
                    errors.is_int(self.batch_size) and self.batch_size >= 1,
                    "an int >= 1",
                ),
                **train_step.schedule_rules(self),
            },
        )


def demonstration_batch(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    *,
    prompt_length: int,
    completion_length: int,
    pad_id: int,
) -> dict[str, np.ndarray]:
    """tokens / attention_mask / loss_mask [B, Tp + Tc]: left-padded prompt, right-padded answer."""
    for name, seqs, width in (
        ("prompt", prompts, prompt_length),
        ("completion", completions, completion_length),
    ):
        longest = max(len(s) for s in seqs)
        if longest > width:
            raise ValueError(f"a {name} has {longest} tokens; the batch holds {width}")
    p, pm = sampler.left_pad(prompts, [len(x) for x in prompts], width=prompt_length, pad_id=pad_id)
    c = np.full((len(completions), completion_length), pad_id, np.int32)
    cm = np.zeros_like(c, bool)
    for i, row in enumerate(completions):
        c[i, : len(row)], cm[i, : len(row)] = row, True
    return dict(
        tokens=np.concatenate([p, c], 1),
        attention_mask=np.concatenate([pm, cm], 1),
        loss_mask=np.concatenate([np.zeros_like(pm), cm], 1),
    )


def packed_batch(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`demonstration_batch`'s [B, T] rows packed into [R, T] rows (R a multiple of
    ROW_MULTIPLE, at most B rounded up), with their `segment_ids` (the forward restarts the
    positions at every segment)."""
    plan = packing.plan(batch["attention_mask"], budget=batch["tokens"].shape[1])
    rows = -(-plan.num_rows // ROW_MULTIPLE) * ROW_MULTIPLE
    plan = dataclasses.replace(plan, num_rows=rows)  # the same placement, padding rows added
    segment_ids = plan.segment_ids
    return dict(
        tokens=plan.pack(batch["tokens"]),
        attention_mask=segment_ids > 0,
        loss_mask=plan.pack(batch["loss_mask"], fill=False),
        segment_ids=segment_ids,
    )


def nll(model: config_lib.ModelConfig, params: dict, batch: dict) -> jax.Array:
    """Mean NLL over completion tokens (+ the router's aux loss); packed rows (`packed_batch`)
    or padded rows (`demonstration_batch`)."""
    tl = train_step.token_logps(
        model, params, batch["tokens"], batch["attention_mask"],
        segment_ids=batch.get("segment_ids"),
    )  # fmt: skip
    m = batch["loss_mask"]
    loss = -jnp.where(m, tl.logps, 0.0).sum() / jnp.maximum(m.sum(), 1)
    return loss + tl.aux.total


def sft_step(model, optimizer: optax.GradientTransformation, params, opt_state, batch):
    """One optimiser step on `nll`: (params, opt_state, loss). Not jitted here: the trainer
    jits it with the run's shardings in and out (`trainer._warm_start`)."""
    loss, grads = jax.value_and_grad(functools.partial(nll, model))(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
