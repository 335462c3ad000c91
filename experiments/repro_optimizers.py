"""GRPO vs GSPO vs ESPO vs CISPO with the real trainer: same tasks, warm start, seeds and budget.

Run:  python experiments/repro_optimizers.py [--preset quick|cpu|large] [--seeds 0,1]
                                             [--losses grpo,gspo,espo,cispo] [--out DIR]

The ESPO paper (arXiv 2512.00499) claims ESPO keeps more gradient signal than sequence-level GSPO
(which clips whole sequences) and is more stable than token-level GRPO. Each loss trains the
embedded default task (reasoning-gym arithmetic chains, `configs/default.py`) from one shared
warm start for the preset's steps; everything else (ZVE, router replay, FP8 rollouts, curriculum,
learning rate) is the default, except four optimiser updates per step (`train.mini_batch_size`,
see COMMON) so that the clip ranges act. Written to OUT (default runs/repro/optimizers):
- results.md / results.json: per loss, held-out greedy pass@1 at the start and the end (mean ±
  std over seeds), token entropy, gradient utilisation (`loss/grad_token_frac`: the share of
  loss tokens whose policy-gradient term moves their log-prob), the same split by entropy group
  (group 0 = the top `loss.top_frac` entropies of a sequence, for every loss) with the share
  clipped away, the clip fraction and the largest gradient norm (stability).
- heldout.png (pass@1 and pass@k), entropy.png, grad_use.png, clipped.png: curves, mean over
  seeds with the min-max band.
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import repro_lib  # noqa: E402

LOSSES = ("grpo", "gspo", "espo", "cispo")
# Four optimiser updates per step (verl's ppo_mini_batch_size): after the first, the policy has
# moved off the rollout's, so the ratios leave 1 and the losses' clip ranges act. (With one
# update per batch every ratio is exactly 1 and no loss clips anything.)
COMMON = {"cpu": {"train.mini_batch_size": 64}, "large": {"train.mini_batch_size": 256}}


def arms(names=LOSSES) -> list[repro_lib.Arm]:
    return [repro_lib.Arm(name, {"loss.name": name}, label=name.upper()) for name in names]


def summarize(runs: dict[str, list[list[dict]]], arm_list) -> tuple[list[str], dict]:
    """The Markdown sections and the JSON numbers of the finished runs."""
    rows, data = [], {}
    cols = {
        "pass@1 start": lambda r: repro_lib.series(r, "eval/pass@1")[1][0],
        "pass@1 end": lambda r: repro_lib.last(r, "eval/pass@1"),
        "pass@1 change": lambda r: repro_lib.change(r, "eval/pass@1"),
        "pass@k end": lambda r: repro_lib.last(r, _pass_k(r)),
        "entropy": lambda r: repro_lib.mean_over(r, "loss/entropy"),
        "grad tokens": lambda r: repro_lib.mean_over(r, "loss/grad_token_frac"),
        "grad hi-H": lambda r: repro_lib.mean_over(r, "loss/grad_frac_group0"),
        "grad lo-H": lambda r: repro_lib.mean_over(r, "loss/grad_frac_group1"),
        "clipped hi-H": lambda r: repro_lib.mean_over(r, "loss/clipped_frac_group0"),
        "clipped lo-H": lambda r: repro_lib.mean_over(r, "loss/clipped_frac_group1"),
        "clip frac": lambda r: repro_lib.mean_over(r, "loss/clip_frac"),
        "max grad norm": lambda r: max(repro_lib.series(r, "optim/grad_norm")[1], default=0.0),
    }
    for arm in arm_list:
        values = {c: repro_lib.per_seed(runs[arm.name], fn) for c, fn in cols.items()}
        data[arm.name] = values
        rows.append([arm.title, *(repro_lib.spread(v) for v in values.values())])
    table = repro_lib.markdown_table(["loss", *cols], rows)
    notes = (
        "Mean over the RL steps (entropy, gradient utilisation, clipping) or the last eval "
        "(pass@1 greedy, pass@k of eval.samples draws); ± is the std over seeds. A seed also "
        "draws the task instances (reasoning-gym), so the held-out set differs between seeds: "
        "compare the change within a seed. hi-H / lo-H: "
        "the ESPO entropy groups (top loss.top_frac of each sequence's tokens by entropy / the "
        "rest); 'clipped' = share of the group's tokens with a nonzero advantage and no "
        "gradient."
    )
    return [table, notes], data


def _pass_k(records: list[dict]) -> str:
    keys = [k for k in records[0] if k.startswith("eval/pass@") and "/" not in k[len("eval/") :]]
    return next((k for k in keys if k != "eval/pass@1"), "eval/pass@1")


def plots(out: pathlib.Path, runs, arm_list) -> list[pathlib.Path]:
    curves = repro_lib.curves_of(runs, arm_list)
    first = runs[arm_list[0].name][0]
    return [
        repro_lib.plot(out / "heldout.png", [("eval/pass@1", "greedy pass@1"),
                                             (_pass_k(first), "pass@k")], curves,
                       title="Held-out accuracy"),
        repro_lib.plot(out / "entropy.png", [("loss/entropy", "token entropy (nats)")], curves),
        repro_lib.plot(out / "grad_use.png", [("loss/grad_token_frac", "all tokens"),
                                              ("loss/grad_frac_group0", "high-entropy group"),
                                              ("loss/grad_frac_group1", "low-entropy group")],
                       curves, title="Gradient utilisation (share of tokens with gradient)"),
        repro_lib.plot(out / "clipped.png", [("loss/clipped_frac_group0", "high-entropy group"),
                                             ("loss/clipped_frac_group1", "low-entropy group")],
                       curves, title="Tokens clipped away (nonzero advantage, no gradient)"),
    ]  # fmt: skip


def main(argv=None) -> dict:
    parser = repro_lib.parser(__doc__, out="runs/repro/optimizers", seeds="0,1")
    parser.add_argument("--losses", default=",".join(LOSSES))
    args = parser.parse_args(argv)
    arm_list = arms(args.losses.split(","))
    return repro_lib.experiment(
        args,
        argv,
        arm_list,
        script="repro_optimizers.py",
        title="GRPO vs GSPO vs ESPO vs CISPO",
        summarize=summarize,
        plots=plots,
        common=COMMON.get(args.preset, {}),
    )


if __name__ == "__main__":
    main()
