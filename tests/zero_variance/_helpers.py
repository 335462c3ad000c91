"""Fake policies and helpers shared by the espo.zero_variance tests (tests/zero_variance).

Two fakes: `BernoulliPolicy` samples reward 1 with probability p (seeded numpy RNG) for the
statistical checks; `QuantilePolicy` gives exactly round(p * G) ones then zeros, so p in (0, 1)
is always informative and p in {0, 1} always zero-variance, for exact counting tests. Its rows
carry a payload ("tokens": a serial number per generated row) so tests can check which rows a
batch holds; `group_list` is a table as one dict per group (the view the tests compare), `stream`
an endless prompt iterator and `fill` one `fill_batch` call with a ZveConfig from keywords.

Not a test module; the tests load it by path (`espo.testing.load_script`), since tests/ is not a
package and pytest runs with --import-mode=importlib.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from espo import zero_variance as zv


def make_prompts(rates) -> list[dict]:
    return [{"question": f"q{i}", "p": float(r)} for i, r in enumerate(rates)]


class BernoulliPolicy:
    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.sampled: list[str] = []  # questions passed to `sample`, in order

    def sample(self, prompts, num_samples):
        self.sampled += [p["question"] for p in prompts]
        p = np.array([[q["p"]] for q in prompts])  # [P, 1]
        return (self.rng.random((len(prompts), num_samples)) < p).astype(np.float32)  # [P, N]


class QuantilePolicy:
    def __init__(self):
        self.calls: list[list[int]] = []  # the group sizes of each generate call
        self.made: list[zv.Groups] = []  # every table generated, in order
        self.num_rows = 0

    def generate(self, prompts, group_sizes):
        self.calls.append([int(g) for g in group_sizes])
        rewards = [(np.arange(g) < round(p["p"] * g)).astype(np.float32)  # [G]
                   for p, g in zip(prompts, group_sizes, strict=True)]  # fmt: skip
        n = int(np.sum(group_sizes))
        tokens = self.num_rows + np.arange(n)[:, None] * np.ones(3, np.int32)  # [n, 3] row serial
        self.num_rows += n
        out = zv.Groups.of(prompt_ids=[zv.prompt_id(p) for p in prompts], rewards=rewards)
        out = dataclasses.replace(out, rows={"tokens": tokens})
        self.made.append(out)
        return out


def group_list(table: zv.Groups) -> list[dict]:
    """The table as one dict per group (prompt id, rewards, tokens, age): the reference view."""
    starts = np.cumsum(table.group_sizes) - table.group_sizes
    return [
        dict(prompt_id=pid, age=int(table.ages[g]),
             rewards=table.rewards[s : s + n].tolist(),
             tokens=table.rows["tokens"][s : s + n].tolist() if "tokens" in table.rows else None)
        for g, (pid, s, n) in enumerate(zip(table.prompt_ids, starts, table.group_sizes,
                                            strict=True))
    ]  # fmt: skip


def stream(rates):
    """An endless prompt iterator cycling through `rates`."""
    return iter(itertools.cycle(make_prompts(rates)))


def fill(rates_or_iter, *, policy, batch_size=4, group_size=4, buffer=None, history=None, **cfg):
    prompts = stream(rates_or_iter) if isinstance(rates_or_iter, list) else rates_or_iter
    return zv.fill_batch(
        prompts=prompts,
        generate=policy.generate,
        batch_size=batch_size,
        group_size=group_size,
        config=zv.ZveConfig(**cfg),
        buffer=buffer,
        history=history,
    )
