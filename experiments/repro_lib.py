"""What the `experiments/repro_*.py` scripts share: arms of real `espo.trainer.train` runs from one
warm start, their curves read back from each run's metrics.jsonl, Markdown tables, PNG plots.

An experiment is a set of arms (config overrides) x seeds. `warm_start` trains the supervised
warm start once (`train.steps=0`); every arm starts from its params (`model.init_from`) and
differs from the others only in its overrides and its seed, so the spread over seeds is the
spread of RL alone. Every run lives in OUT/<arm>/seed<k>: rerunning a script resumes the runs cut
short (the trainer's exact resume) and skips the finished ones (their summary.json is there).

Presets: "quick" (the tiny config, a couple of steps: what the tests run so no script can rot),
"cpu" (the embedded default model at a scale 2 cores finish in minutes an arm) and "large" (a
bigger model and budget for a GPU/TPU host).
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import math
import pathlib
import sys
from collections.abc import Callable, Mapping, Sequence

import ml_collections
import numpy as np
from matplotlib import figure as mpl_figure
from matplotlib.backends import backend_agg

from espo import checkpoint, metrics, testing, trainer

ROOT = pathlib.Path(__file__).resolve().parents[1]
PRESETS = ("quick", "cpu", "large", "default")

# The config the reproductions run: configs/arithmetic.py, the task their tables in docs/repro/
# were measured on (issue 33 moves them to configs/default.py); the testbed's controls
# (repro_testbed.py) pass config_name="default".
CONFIG = "arithmetic"
# Config overrides of each preset on the config ("quick" starts from its tiny variant).
# The reproductions sample at temperature 1 (their README tables were measured so; the default
# trains at 0.6).
_SAMPLING = {"rollout.temperature": 1.0}
_PRESET_OVERRIDES = {
    "quick": {"train.steps": 1, "checkpoint.every_steps": 1, **_SAMPLING},
    "cpu": {
        **_SAMPLING,
        "train.steps": 30,
        "eval.every_steps": 10,
        "eval.num_prompts": 128,
        "eval.samples": 4,
        "checkpoint.every_steps": 10,
    },
    "default": {},  # the config as it is (make run's settings, for configs/default.py)
    "large": {
        **_SAMPLING,
        "model.d_model": 256,
        "model.num_layers": 8,
        "model.num_experts": 32,
        "model.moe_ffn_dim": 256,
        "sft.steps": 1000,
        "train.steps": 200,
        "train.prompts_per_step": 64,
        "eval.every_steps": 20,
        "eval.num_prompts": 512,
        "checkpoint.every_steps": 20,
    },
}


def config_module(name: str = CONFIG):
    """configs/<name>.py as a module (its `get_config`, its `stage` helper)."""
    return testing.load_script(ROOT / "configs" / f"{name}.py", name=f"espo_{name}_config")


def config(
    preset: str, overrides: Mapping[str, object] = (), *, name: str = CONFIG
) -> ml_collections.ConfigDict:
    """configs/<name>.py at `preset`, then `overrides` ({"loss.name": "grpo", ...})."""
    if preset not in PRESETS:
        raise ValueError(f"preset={preset!r} is invalid; valid: {', '.join(PRESETS)}")
    cfg = config_module(name).get_config("tiny" if preset == "quick" else "")
    return set_fields(cfg, {**_PRESET_OVERRIDES[preset], **dict(overrides)})


def set_fields(
    cfg: ml_collections.ConfigDict, overrides: Mapping[str, object]
) -> ml_collections.ConfigDict:
    """`cfg` with each dotted field of `overrides` ({"loss.name": "grpo", ...}) set; a field the
    config does not have is a KeyError naming it."""
    for key, value in dict(overrides).items():
        section, _, field = key.rpartition(".")
        node = cfg
        for part in section.split(".") if section else ():
            node = node[part]
        if field not in node:
            raise KeyError(f"override {key!r}: no such config field")
        node[field] = value
    return cfg


@dataclasses.dataclass(frozen=True)
class Arm:
    """One setting of an experiment: a name (its directory) and its config overrides."""

    name: str
    overrides: Mapping[str, object]
    label: str = ""  # legend / table name; "" = name

    @property
    def title(self) -> str:
        return self.label or self.name


def run(cfg: ml_collections.ConfigDict, workdir: pathlib.Path, *, progress: bool) -> list[dict]:
    """Trains (or resumes) the run in `workdir` unless it finished; its metrics.jsonl records.

    A workdir holding a run of other settings is an error (a resume would mix the two)."""
    saved = workdir / "config.json"
    if saved.exists():
        old, new = (
            checkpoint.flatten_config(json.loads(saved.read_text())),
            checkpoint.flatten_config(json.loads(cfg.to_json_best_effort())),
        )
        differ = sorted(k for k in old.keys() & new.keys() if old[k] != new[k])  # a key added
        if differ:  # to the config since the run started is taken to hold its default
            raise ValueError(
                f"{workdir} holds a run of other settings than this experiment's "
                f"({', '.join(differ)} differ); use another --out, or delete it"
            )
    done = workdir / "summary.json"
    if not done.exists() or json.loads(done.read_text())["steps"] != cfg.train.steps:
        trainer.train(cfg, str(workdir), progress=progress)
    return metrics.read_jsonl(workdir / "metrics.jsonl")


def warm_start(
    workdir: pathlib.Path,
    preset: str,
    *,
    seed: int,
    progress: bool,
    name: str = CONFIG,
    shared: Mapping[str, object] = (),
) -> pathlib.Path:
    """The supervised warm start every arm starts from (a run of train.steps=0 in `workdir`);
    `shared` overrides (e.g. the model's shape) apply to it and to every arm."""
    cfg = config(preset, {**dict(shared), "seed": seed, "train.steps": 0}, name=name)
    run(cfg, workdir, progress=progress)
    return workdir


def run_arms(
    out: pathlib.Path,
    preset: str,
    arms: Sequence[Arm],
    seeds: Sequence[int],
    *,
    progress: bool = True,
    common: Mapping[str, object] = (),
    warm: pathlib.Path | None = None,
    name: str = CONFIG,
    shared: Mapping[str, object] = (),
    warm_seed: int | None = None,
) -> dict[str, list[list[dict]]]:
    """{arm name: [records of seed k]} after every arm x seed of configs/<name>.py ran from one
    warm start (in `warm`, default OUT/warm_start; scripts given the same directory share it),
    trained with `warm_seed` (default the first RL seed).
    Overrides: `shared` of the warm start and every arm, then `common`, then the arm's."""
    warm = warm or out / "warm_start"
    seed0 = seeds[0] if warm_seed is None else warm_seed
    base = warm_start(warm, preset, seed=seed0, progress=progress, name=name, shared=shared)
    runs = {}
    for arm in arms:
        runs[arm.name] = []
        for seed in seeds:
            overrides = {**dict(shared), **dict(common), **dict(arm.overrides), "seed": seed}
            overrides["model.init_from"] = str(base)
            cfg = config(preset, overrides, name=name)
            print(f"== {arm.title}, seed {seed}", flush=True)
            runs[arm.name].append(run(cfg, out / arm.name / f"seed{seed}", progress=progress))
    return runs


def write_records(
    records: pathlib.Path, out: pathlib.Path, arms: Sequence[Arm], seeds: Sequence[int]
) -> None:
    """RECORDS/<arm>/seed<k>.jsonl.gz: each run's metrics.jsonl, gzipped byte for byte (a few
    kB a run: the raw curves a results table is computed from, small enough to keep beside it
    and summarize again with --records)."""
    for arm in arms:
        for seed in seeds:
            path = records / arm.name / f"seed{seed}.jsonl.gz"
            path.parent.mkdir(parents=True, exist_ok=True)
            raw = (out / arm.name / f"seed{seed}" / "metrics.jsonl").read_bytes()
            path.write_bytes(gzip.compress(raw, mtime=0))


def read_records(
    records: pathlib.Path, arms: Sequence[Arm], seeds: Sequence[int]
) -> dict[str, list[list[dict]]]:
    """{arm name: [records of seed k]} from `write_records`' files; a missing one names itself."""
    runs = {}
    for arm in arms:
        runs[arm.name] = []
        for seed in seeds:
            path = records / arm.name / f"seed{seed}.jsonl.gz"
            if not path.is_file():
                raise FileNotFoundError(
                    f"--records: {path} is missing (arm {arm.name}, seed {seed})"
                )
            runs[arm.name].append(metrics.read_jsonl(path))
    return runs


# ---- reading curves --------------------------------------------------------------------------
def series(records: Sequence[dict], key: str, x: str = "step") -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of the records that hold a finite `key` (eval metrics: the eval steps only).

    x="step", or a per-step metric to accumulate (e.g. "train/rollouts": compute spent so far).
    """
    xs = np.array([r["step"] for r in records], float)
    if x != "step":
        xs = np.cumsum([r.get(x) or 0.0 for r in records])
    keep = [i for i, r in enumerate(records) if _finite(r.get(key))]
    return xs[keep], np.array([records[i][key] for i in keep], float)


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def last(records: Sequence[dict], key: str) -> float:
    """The newest finite value of `key` (nan when there is none)."""
    _, ys = series(records, key)
    return float(ys[-1]) if len(ys) else math.nan


def change(records: Sequence[dict], key: str) -> float:
    """The last finite value of `key` minus the first (e.g. held-out accuracy gained)."""
    _, ys = series(records, key)
    return float(ys[-1] - ys[0]) if len(ys) else math.nan


def mean_over(records: Sequence[dict], key: str, *, first_step: int = 1) -> float:
    """The mean of `key` over the steps >= first_step that hold it (nan when none do)."""
    xs, ys = series(records, key)
    ys = ys[xs >= first_step]
    return float(ys.mean()) if len(ys) else math.nan


def spread(values: Sequence[float], digits: int = 3) -> str:
    """'m' for one value, 'm ± s' (population std over seeds) for several; nan-safe."""
    v = np.array([x for x in values if _finite(x)], float)
    if not len(v):
        return "n/a"
    small = 0 < abs(v.mean()) < 10.0**-digits  # would print as 0.000: scientific
    fmt = (lambda x: f"{x:.2e}") if small else (lambda x: f"{x:.{digits}f}")
    return fmt(v[0]) if len(v) == 1 else f"{fmt(v.mean())} ± {fmt(v.std())}"


def interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """(mean, half-width of the two-sided Student-t interval of the mean) over seeds; the
    half-width is nan for fewer than 2 finite values."""
    from scipy import stats  # only the summaries need it

    v = np.array([x for x in values if _finite(x)], float)
    if len(v) < 2:
        return (float(v.mean()) if len(v) else math.nan), math.nan
    t = float(stats.t.ppf(0.5 + confidence / 2, df=len(v) - 1))
    return float(v.mean()), t * float(v.std(ddof=1)) / math.sqrt(len(v))


def ci(values: Sequence[float], digits: int = 3) -> str:
    """'m ± h [lo, hi]' with the 95% t-interval over seeds ('m' for one value)."""
    m, h = interval(values)
    if not math.isfinite(h):
        return "n/a" if not math.isfinite(m) else f"{m:.{digits}f}"
    return f"{m:.{digits}f} ± {h:.{digits}f} [{m - h:.{digits}f}, {m + h:.{digits}f}]"


def paired_ci(data: Mapping[str, Mapping[str, list]], base: str, arm: str, column: str) -> str:
    """`ci` of `base`'s per-seed `column` minus `arm`'s (the same seeds, paired) and how many
    seeds are above 0; "" when `arm` is `base` or either did not run."""
    if arm == base or base not in data or arm not in data:
        return ""
    return paired_difference(data[base][column], data[arm][column])


def paired_row(label: str, xs: Sequence[float], ys: Sequence[float]) -> list:
    """A table row comparing two arms seed by seed: [label, "+a / +b / ...", paired_difference]."""
    diffs = " / ".join(f"{x - y:+.3f}" for x, y in zip(xs, ys, strict=True))
    return [label, diffs, paired_difference(xs, ys)]


def paired_difference(xs: Sequence[float], ys: Sequence[float], digits: int = 3) -> str:
    """`ci` of the per-seed differences xs[k] - ys[k] (the same seeds, paired) and how many of
    them are above 0: 'm ± h [lo, hi] (n / N seeds > 0)'."""
    diff = [x - y for x, y in zip(xs, ys, strict=True)]
    return f"{ci(diff, digits)} ({sum(d > 0 for d in diff)} / {len(diff)} seeds > 0)"


def welch_interval(
    xs: Sequence[float], ys: Sequence[float], confidence: float = 0.95
) -> tuple[float, float]:
    """(mean(xs) - mean(ys), the half-width of its two-sided Welch t-interval): two independent
    samples of seeds (not paired), unequal variances; nan half-width below 2 values a side."""
    from scipy import stats

    x = np.array([v for v in xs if _finite(v)], float)
    y = np.array([v for v in ys if _finite(v)], float)
    if not (len(x) and len(y)):
        return math.nan, math.nan
    diff = float(x.mean() - y.mean())
    if len(x) < 2 or len(y) < 2:
        return diff, math.nan
    vx, vy = x.var(ddof=1) / len(x), y.var(ddof=1) / len(y)
    se = math.sqrt(vx + vy)
    if se == 0.0:
        return diff, 0.0
    df = (vx + vy) ** 2 / (vx**2 / (len(x) - 1) + vy**2 / (len(y) - 1))
    return diff, float(stats.t.ppf(0.5 + confidence / 2, df=df)) * se


def welch_difference(xs: Sequence[float], ys: Sequence[float], digits: int = 3) -> str:
    """'m ± h [lo, hi] (Welch)': `welch_interval` of mean(xs) - mean(ys), unpaired."""
    m, h = welch_interval(xs, ys)
    if not math.isfinite(h):
        return "n/a" if not math.isfinite(m) else f"{m:+.{digits}f}"
    return f"{m:+.{digits}f} ± {h:.{digits}f} [{m - h:.{digits}f}, {m + h:.{digits}f}] (Welch)"


def binomial_half_width(p: float, n: int, confidence: float = 0.95) -> float:
    """The half-width of the normal-approximation (Wald) interval of a share `p` measured on `n`
    independent prompts: what one evaluation's prompt sample alone leaves uncertain."""
    from scipy import stats

    return float(stats.norm.ppf(0.5 + confidence / 2)) * math.sqrt(p * (1.0 - p) / n)


def per_seed(runs: Sequence[list[dict]], fn: Callable[[list[dict]], float]) -> list[float]:
    return [fn(records) for records in runs]


def heldout_columns(key: str = "eval/pass@1", name: str = "pass@1") -> dict[str, Callable]:
    """Per-run columns of a held-out metric: its first value, last value and the change."""
    return {
        f"{name} start": lambda r: series(r, key)[1][0],
        f"{name} end": lambda r: last(r, key),
        f"{name} change": lambda r: change(r, key),
    }


def testbed_columns(k: int, key: str = "eval/pass@1") -> dict[str, Callable]:
    """Per-run columns of a testbed run (configs/default.py): greedy pass@1 at the start, the end
    and the change; maj@k / pass@k of the warm start and pass@k at the end; process fidelity and
    the right answers reached by a wrong process at the end."""
    first = lambda name: lambda r: series(r, name)[1][0]
    final = lambda name: lambda r: last(r, name)
    return {
        "pass@1 start": first(key),
        "pass@1 end": final(key),
        "change": lambda r: change(r, key),
        f"maj@{k} start": first(f"eval/maj@{k}"),
        f"pass@{k} start": first(f"eval/pass@{k}"),
        f"pass@{k} end": final(f"eval/pass@{k}"),
        "process fidelity end": final("eval/process_fidelity"),
        "right answer, wrong process end": final("eval/right_answer_wrong_process"),
    }


# ---- the testbed's reference points ----------------------------------------------------------
def eval_examples(
    cfg: ml_collections.ConfigDict, *, split: str | None = None, num_prompts: int | None = None
) -> list:
    """The held-out examples a run of `cfg` evaluates, in its order, chosen as `espo.trainer`
    chooses them (`trainer.held_out_examples`). `split` / `num_prompts` replace
    eval.split / eval.num_prompts (the dev split the pilots tuned on). Generates the data, runs
    nothing."""
    from espo import config as config_lib
    from espo.data import sources
    from espo.data import tokenizer as tokenizer_lib

    s = config_lib.Settings.from_config(cfg)
    tok = tokenizer_lib.load_tokenizer(s.hf_path)
    _, held_out = sources.make_sources(s.data)
    count = lambda e: len(tok.encode_prompt(e.prompt))
    return trainer.held_out_examples(s, held_out, count, split=split, num_prompts=num_prompts)


def teacher_ceiling(examples: Sequence, *, flaw: str, error: float) -> dict[str, float]:
    """The greedy pass@1 on `examples` of a model that has learnt the chains teacher exactly:
    greedy decoding takes the teacher's most likely answer, so with the "final_sign" flaw at
    error > 0.5 every negative answer loses its sign and the ceiling is the share of answers
    >= 0 (error < 0.5 or flaw "none": every answer right). {"prompts", "negative", "ceiling"};
    the "sign" flaw (several values can flip) and error 0.5 (a tie) raise."""
    if flaw not in ("none", "final_sign") or (flaw == "final_sign" and error == 0.5):
        raise ValueError(
            f"teacher_ceiling: flaw={flaw!r}, error={error}; valid: flaw 'none', or "
            "'final_sign' with error != 0.5"
        )
    negative = sum(int(e.answer) < 0 for e in examples)
    wrong = negative if flaw == "final_sign" and error > 0.5 else 0
    n = len(examples)
    return {"prompts": n, "negative": negative, "ceiling": (n - wrong) / n if n else math.nan}


def ceiling_of(cfg: ml_collections.ConfigDict, **kw) -> dict[str, float]:
    """`teacher_ceiling` on the held-out prompts a run of `cfg` evaluates (`eval_examples`)."""
    d = cfg.data
    examples = eval_examples(cfg, **kw)
    return teacher_ceiling(examples, flaw=d.teacher_flaw, error=d.teacher_error)


# ---- stability: the stress rows' collapse and held-out area ----------------------------------
COLLAPSE_DROP, ENTROPY_FLOOR = 0.10, 0.1


def collapsed(records: list[dict]) -> float:
    """1.0 when the run collapsed (a held-out drop past COLLAPSE_DROP from its start, or a
    step's token entropy below ENTROPY_FLOOR x the first step's), else 0.0."""
    _, acc = series(records, "eval/pass@1")
    _, ent = series(records, "loss/entropy")
    dropped = len(acc) > 1 and float(acc[1:].min()) < acc[0] - COLLAPSE_DROP
    frozen = len(ent) > 1 and float(ent[1:].min()) < ENTROPY_FLOOR * ent[0]
    return float(dropped or frozen)


def heldout_area(records: list[dict]) -> float:
    """Mean held-out pass@1 over the run: the area under its eval curve / the steps it spans."""
    steps, acc = series(records, "eval/pass@1")
    if len(acc) < 2:
        return float(acc[0]) if len(acc) else float("nan")
    area = float(np.sum((acc[1:] + acc[:-1]) / 2 * np.diff(steps)))
    return area / float(steps[-1] - steps[0])


def stability_columns() -> dict[str, Callable[[list[dict]], float]]:
    """The stress rows' per-run columns: collapsed (0 / 1), the held-out area, the largest
    gradient norm."""
    return {
        "collapsed": collapsed,
        "held-out area": heldout_area,
        "max grad norm": lambda r: max(series(r, "optim/grad_norm")[1], default=0.0),
    }


def stability_header(base: str) -> list[str]:
    """The headers of `stability_cells`, `base` naming the arm the areas are paired with."""
    return ["collapses / seeds", "held-out area (95% CI)",
            f"{base}'s area minus it, paired (95% CI)", "final pass@1 (95% CI)"]  # fmt: skip


def stability_cells(data: Mapping[str, Mapping[str, list]], arm: str, base: str) -> list[str]:
    """An arm's first cells of a stress table (`stability_columns` and `heldout_columns` in
    `data`): collapses / seeds, the held-out area, `base`'s area minus it paired by seed, the
    final pass@1, with 95% t-intervals over seeds."""
    d = data[arm]
    return [
        f"{sum(d['collapsed']):.0f} / {len(d['collapsed'])}",
        ci(d["held-out area"]),
        paired_ci(data, base, arm, "held-out area"),
        ci(d["pass@1 end"]),
    ]


# ---- writing results -------------------------------------------------------------------------
def arm_table(
    runs: Mapping[str, list[list[dict]]], arms: Sequence[Arm], cols: Mapping[str, Callable]
) -> tuple[str, dict]:
    """A Markdown row per arm (each column's `spread` over seeds) and {arm: {column: [seeds]}}."""
    data = {a.name: {c: per_seed(runs[a.name], f) for c, f in cols.items()} for a in arms}
    rows = [[a.title, *(spread(v) for v in data[a.name].values())] for a in arms]
    return markdown_table(["arm", *cols], rows), data


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def plot(
    path: pathlib.Path,
    panels: Sequence[tuple[str, ...]],
    curves: Callable[[str], Mapping[str, Sequence[tuple[np.ndarray, np.ndarray]]]],
    *,
    xlabel: str = "RL step",
    title: str = "",
) -> pathlib.Path:
    """One PNG with a panel per (key, y label[, "log"]); `curves(key)` -> {arm label: [(x, y) per
    seed]}; "log" draws the panel's y axis on a log scale.

    Each arm is the mean over its seeds (on the x of its first seed) with the min-max band.
    """
    fig = mpl_figure.Figure(figsize=(5.0 * len(panels), 3.6), dpi=110)
    backend_agg.FigureCanvasAgg(fig)
    for i, (key, ylabel, *scale) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        if scale == ["log"]:
            ax.set_yscale("log")
        for label, seeds in curves(key).items():
            seeds = [(x, y) for x, y in seeds if len(y)]
            if not seeds:
                continue
            n = min(len(y) for _, y in seeds)
            xs, ys = seeds[0][0][:n], np.stack([y[:n] for _, y in seeds])
            (line,) = ax.plot(xs, ys.mean(0), label=label, marker="o" if n <= 12 else None)
            if len(seeds) > 1:
                ax.fill_between(xs, ys.min(0), ys.max(0), color=line.get_color(), alpha=0.2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(key, fontsize=9)
        ax.grid(alpha=0.3)
        if i == 0:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def write_results(out: pathlib.Path, title: str, sections: Sequence[str], data: dict) -> str:
    """OUT/results.md (title, command, sections) and OUT/results.json (`data`)."""
    text = f"# {title}\n\n" + "\n\n".join(sections) + "\n"
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps(data, indent=2, default=float) + "\n")
    return text


def parser(doc: str, *, out: str, seeds: str) -> argparse.ArgumentParser:
    """The options every repro script takes: --preset / --quick, --seeds, --out, --no-progress."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--preset", choices=PRESETS, default="cpu")
    p.add_argument("--quick", action="store_const", const="quick", dest="preset")
    p.add_argument("--seeds", default=seeds, help="comma-separated RL seeds")
    p.add_argument("--out", default=out, help="output directory (rerun: resumes)")
    p.add_argument(
        "--warm-start",
        default=None,
        help="directory of the shared warm start (default runs/repro/warm_start_PRESET_SEED; "
        "every script given the same one trains it once)",
    )
    p.add_argument(
        "--records",
        default=None,
        help="summarize the saved records in this directory (RECORDS/<arm>/seed<k>.jsonl.gz, "
        "e.g. docs/repro/<name>/records) instead of running",
    )
    p.add_argument("--no-progress", action="store_true")
    return p


def seeds_of(args: argparse.Namespace) -> list[int]:
    return [int(s) for s in args.seeds.split(",")]


def curves_of(runs: Mapping[str, list[list[dict]]], arms: Sequence[Arm]):
    """`plot`'s `curves`: key -> {arm label: [(step, value) of each seed]}."""
    return lambda key: {a.title: [series(r, key) for r in runs[a.name]] for a in arms}


def finish(
    args: argparse.Namespace,
    argv: Sequence[str] | None,
    *,
    script: str,
    title: str,
    sections: Sequence[str],
    files: Sequence[pathlib.Path],
    data: dict,
) -> None:
    """Writes and prints OUT/results.md (with the command that made it) and results.json."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = " ".join(["python", f"experiments/{script}", *argv])
    head = f"`{command}` (preset {args.preset}, seeds {seeds_of(args)})"
    pictures = "\n".join(f"![{f.stem}]({f.name})" for f in files)
    print(write_results(pathlib.Path(args.out), title, [head, *sections, pictures], data))


def warm_dir(args: argparse.Namespace, *, own: bool = False) -> pathlib.Path:
    """--warm-start, or runs/repro/warm_start_<preset>_<first seed> (the scripts' shared one), or
    OUT/warm_start when `own` (a warm start with `shared` overrides is no other script's)."""
    if args.warm_start:
        return pathlib.Path(args.warm_start)
    if own:
        return pathlib.Path(args.out) / "warm_start"
    return pathlib.Path("runs/repro") / f"warm_start_{args.preset}_{seeds_of(args)[0]}"


def parse_arms(
    doc: str,
    argv: Sequence[str] | None,
    *,
    out: str,
    arms: Mapping[str, Arm] | Callable[[str], Mapping[str, Arm]],
    preset: str = "cpu",
    seeds: str = "0",
    default: str = "",
) -> tuple[argparse.Namespace, list[Arm]]:
    """`parser`'s options plus --arms (comma-separated; default `default`, "" = all): (args, the
    chosen arms). `arms` may depend on the preset: a function of it. `preset`, `seeds`: the
    defaults."""
    p = parser(doc, out=out, seeds=seeds)
    p.set_defaults(preset=preset)
    p.add_argument("--arms", default=None, help=f"comma-separated arm names ({default or 'all'})")
    args = p.parse_args(argv)
    known = arms(args.preset) if callable(arms) else arms
    return args, select_arms(p, args.arms or default or ",".join(known), known)


def select_arms(parser: argparse.ArgumentParser, names: str, known: Mapping[str, Arm]) -> list[Arm]:
    """The arms named in a comma-separated --arms value; an unknown name is a usage error."""
    unknown = [a for a in names.split(",") if a not in known]
    if unknown:
        parser.error(f"--arms: unknown {unknown}; valid: {','.join(known)}")
    return [known[a] for a in names.split(",")]


def experiment(
    args: argparse.Namespace,
    argv: Sequence[str] | None,
    arms: Sequence[Arm],
    *,
    script: str,
    title: str,
    summarize: Callable,
    plots: Callable,
    common: Mapping[str, object] = (),
    name: str = CONFIG,
    shared: Mapping[str, object] = (),
) -> dict:
    """Runs `arms` x seeds of configs/<name>.py from the shared warm start, then writes the
    results: `summarize(runs, arms)` -> (Markdown sections, JSON data), `plots(out, runs, arms)`
    -> PNGs; `common` overrides apply to every arm (and not to the warm start), `shared` ones
    to the warm start too (the model's shape)."""
    out = pathlib.Path(args.out)
    if args.records:
        runs = read_records(pathlib.Path(args.records), arms, seeds_of(args))
    else:
        runs = run_arms(
            out, args.preset, arms, seeds_of(args), progress=not args.no_progress,
            warm=warm_dir(args, own=bool(shared)), common=common, name=name, shared=shared,
        )  # fmt: skip
        write_records(out / "records", out, arms, seeds_of(args))
    out.mkdir(parents=True, exist_ok=True)
    sections, data = summarize(runs, arms)
    files = plots(out, runs, arms)
    finish(args, argv, script=script, title=title, sections=sections, files=files, data=data)
    return data
