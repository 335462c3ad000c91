"""The reproduction scripts at --quick (the tiny config, 2 RL steps), so none can rot: every arm
runs the real trainer from one shared warm start, the tables and plots are written (rendered
where a test checks the pixels: `_without_pixels`), and a rerun resumes instead of retraining.
The scripts share one output directory (and the warm starts in it)."""

import json
import pathlib
import shutil

import numpy as np
import pytest
from matplotlib import figure as mpl_figure

from espo import metrics, testing

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load(name):
    return testing.load_script(ROOT / "experiments" / f"{name}.py")


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("repros")


def _without_pixels(monkeypatch):
    """The scripts' figures are built (every panel's curves read and plotted) but not rendered:
    rendering costs ~0.3 s a panel on 2 cores, and only a test that checks a PNG's size needs
    it (test_optimizers_quick's first run, test_replay_paired_quick, test_testbed_quick)."""
    monkeypatch.setattr(mpl_figure.Figure, "tight_layout", lambda self, *a, **k: None)
    monkeypatch.setattr(
        mpl_figure.Figure, "savefig", lambda self, path, *a, **k: pathlib.Path(path).touch()
    )


@pytest.fixture
def no_pixels(monkeypatch):
    _without_pixels(monkeypatch)


@pytest.mark.slow
def test_optimizers_quick(out, monkeypatch):
    repro = _load("repro_optimizers")
    argv = ["--quick", "--seeds", "0,1", "--arms", "gspo", "--out", str(out / "opt")]
    argv += ["--warm-start", str(out / "warm_default")]  # configs/default.py's, as zve's
    data = repro.main([*argv, "--no-progress"])
    assert set(data) == {"gspo"}
    # One warm start: every seed (and arm) starts from the same params and evaluates them with
    # the same key, so the step-0 held-out numbers are identical.
    starts = [v for arm in data.values() for v in arm["pass@1 start"]]
    assert len(starts) == 2 and len(set(starts)) == 1
    for arm in data.values():
        assert all(0 < g <= 1 for g in arm["grad tokens"]), arm
        assert all(0 <= g <= 1 for g in arm["grad adv hi-H"] + arm["grad adv rest"]), arm
        assert all(np.isfinite(arm["entropy"])), arm  # every loss reports its entropy
        assert all(0 <= c <= 1 for c in arm["clipped hi-H"] + arm["clipped rest"]), arm
        assert set(arm["collapsed"]) <= {0.0, 1.0} and all(
            0 <= a <= 1 for a in arm["held-out area"]
        )
    text = (out / "opt" / "results.md").read_text()
    assert "| GSPO |" in text and "--arms gspo" in text
    for png in ("heldout", "entropy", "grad_use", "clipped"):
        assert (out / "opt" / f"{png}.png").stat().st_size > 1000, png
    assert len(list((out / "opt" / "gspo" / "seed1").glob("checkpoints/*"))) >= 1
    _without_pixels(monkeypatch)  # the reruns draw the same figures
    # A rerun finds every run finished: nothing trains, the numbers are the same.
    lib = repro.repro_lib
    with pytest.raises(ValueError, match=r"holds a run of other settings"):
        lib.run(
            lib.config("quick", {"seed": 1, "train.steps": 0}), out / "warm_default", progress=False
        )
    monkeypatch.setattr(lib.trainer, "train", lambda *a, **k: pytest.fail("trained"))
    saved = json.loads((out / "opt" / "results.json").read_text())
    assert repro.main([*argv, "--no-progress"]) == saved
    # The gzipped records (each run's metrics.jsonl) summarize to the same table elsewhere.
    records = out / "opt" / "records"
    assert metrics.read_jsonl(records / "gspo" / "seed1.jsonl.gz") == metrics.read_jsonl(
        out / "opt" / "gspo" / "seed1" / "metrics.jsonl"
    )
    again = ["--quick", "--seeds", "0,1", "--arms", "gspo", "--records", str(records)]
    assert repro.main([*again, "--out", str(out / "opt_again")]) == saved
    with pytest.raises(FileNotFoundError, match="seed2"):
        repro.main(["--quick", "--seeds", "2", "--arms", "gspo", "--records", str(records),
                    "--out", str(out / "opt_none")])  # fmt: skip


def test_optimizers_collapse_and_heldout_area_by_hand():
    repro = _load("repro_optimizers")
    acc = lambda step, v: {"step": step, "eval/pass@1": v}
    ent = lambda step, v: {"step": step, "loss/entropy": v}
    # Evals 0.6 -> 0.8 -> 0.7 at steps 0, 5, 15: area (0.7 * 5 + 0.75 * 10) / 15 = 11 / 15.
    run = [acc(0, 0.6), acc(5, 0.8), acc(15, 0.7)]
    assert abs(repro.heldout_area(run) - 11 / 15) < 1e-12
    assert repro.collapsed(run) == 0.0  # never below the start
    assert repro.collapsed([*run, acc(20, 0.49)]) == 1.0  # 0.11 below the start
    assert repro.collapsed([*run, acc(20, 0.51)]) == 0.0  # 0.09 below: not a collapse
    entropy = [ent(1, 0.02), ent(2, 0.0021)]
    assert repro.collapsed(run + entropy) == 0.0
    assert repro.collapsed([*run, *entropy, ent(3, 0.0019)]) == 1.0  # below 0.1 x 0.02


@pytest.mark.slow
def test_replay_quick(out, no_pixels):
    repro = _load("repro_replay")
    argv = ["--quick", "--arms", "bf16,bf16-free", "--out", str(out / "replay")]
    data = repro.main([*argv, "--warm-start", str(out / "warm"), "--no-progress"])
    replay, free = data["bf16"], data["bf16-free"]
    # bf16 rollouts route some tokens to other experts than the float32 trainer: replaying the
    # rollout's experts removes that part of the mismatch.
    assert free["router agreement"][0] < 1.0
    assert 0 <= replay["k3 KL"][0] < free["k3 KL"][0]
    assert replay["pass@1 start"] == free["pass@1 start"]
    assert "| bf16 no replay |" in (out / "replay" / "results.md").read_text()
    with pytest.raises(SystemExit):
        repro.main(["--quick", "--arms", "bf16,f16", "--out", str(out / "bad")])


@pytest.mark.slow
def test_replay_stress_quick(out, no_pixels):
    """The finer MoE is the warm start's and every arm's model (its own warm start, in OUT);
    both routings start from it (the same step-0 held-out numbers) without FP8 or IS
    correction, and the table pairs free routing with replay."""
    repro = _load("repro_replay_stress")
    stress = out / "replay_stress"
    data = repro.main(["--quick", "--seeds", "0", "--out", str(stress), "--no-progress"])
    for run in ("warm_start", "replay/seed0", "free/seed0"):
        cfg = json.loads((stress / run / "config.json").read_text())
        assert cfg["model"]["num_experts"] == 8, run
    arm = json.loads((stress / "free" / "seed0" / "config.json").read_text())
    assert not arm["train"]["router_replay"] and not arm["rollout"]["fp8"]
    assert arm["loss"]["rollout_is"] == "none" and arm["rollout"]["dtype"] == "bfloat16"
    assert data["replay"]["pass@1 start"] == data["free"]["pass@1 start"]
    assert all(0 <= x <= 1 for x in data["free"]["extreme frac"])
    assert "| free routing |" in (stress / "results.md").read_text()


@pytest.mark.slow
def test_replay_paired_quick(out):
    """Both routings measured on the same batches of one run (configs/default.py's tiny
    variant, its own warm start): FP8 rollouts flip some experts, whose mismatch replay removes."""
    repro = _load("repro_replay_paired")
    argv = ["--quick", "--seeds", "0", "--arms", "fp8", "--out", str(out / "paired")]
    data = repro.main([*argv, "--warm-start", str(out / "warm_default"), "--no-progress"])
    fp8 = data["fp8"]
    assert fp8["steps"] == [1]
    assert 0 <= fp8["k3 replay"][0] < fp8["k3 free"][0]
    assert fp8["k3 free / replay"][0] > 1.0
    layers = [k for k in fp8 if k.startswith("agreement layer")]
    assert layers and all(0.5 < fp8[k][0] <= 1.0 for k in layers)
    assert min(fp8[k][0] for k in layers) < 1.0
    text = (out / "paired" / "results.md").read_text()
    assert "| FP8 weights |" in text and (out / "paired" / "paired.png").stat().st_size > 1000


@pytest.mark.slow
def test_zve_training_quick(out, no_pixels):
    repro = _load("repro_zve_training")
    argv = ["--quick", "--seeds", "0", "--arms", "plain,rl_zvp,offline"]
    argv += ["--out", str(out / "zve")]
    data = repro.main([*argv, "--warm-start", str(out / "warm_default"), "--no-progress"])
    plain, rl_zvp = data["plain"], data["rl_zvp"]
    # The offline arm: the full pipeline from a pass-rate table of the pool estimated before
    # its first step (its rollouts counted in its cost to the target).
    table = json.loads((out / "zve" / "pass_rates.json").read_text())
    assert table["num_samples"] == repro.OFFLINE_SAMPLES and table["pass_rates"]
    cfg = json.loads((out / "zve" / "offline" / "seed0" / "config.json").read_text())
    assert cfg["zve"]["pass_rate_table"] == str(out / "zve" / "pass_rates.json")
    offline = data["offline"][f"rollouts to pass@1 {repro.TARGET}"][0]
    assert offline >= len(table["pass_rates"]) * table["num_samples"] or offline == np.inf
    # Same rollouts (same seed, same warm start); RL-ZVP gives the zero-variance groups'
    # tokens a gradient that plain GRPO's zero advantages do not.
    assert plain["rollouts"] == rl_zvp["rollouts"] and plain["rollouts"][0] > 0
    assert plain["ZVP share of optimiser batch"] == rl_zvp["ZVP share of optimiser batch"]
    assert plain["ZVP share of optimiser batch"][0] > 0
    assert rl_zvp["tokens with gradient"][0] > plain["tokens with gradient"][0]
    assert (out / "zve" / "heldout.png").exists()
    assert "rollouts to pass@1" in (out / "zve" / "results.md").read_text()


def test_zve_rollouts_to_target_count_up_to_the_first_eval_that_reaches_it():
    repro = _load("repro_zve_training")
    records = [
        {"step": 0, "eval/pass@1": 0.7},
        {"step": 1, "train/rollouts": 128.0},
        {"step": 2, "train/rollouts": 160.0, "eval/pass@1": 0.84},
        {"step": 3, "train/rollouts": 128.0, "eval/pass@1": 0.86},
        {"step": 4, "train/rollouts": 128.0, "eval/pass@1": 0.90},
    ]
    assert repro.to_target(records, "train/rollouts", 0.85) == 416.0
    assert repro.to_target(records, "train/rollouts", 0.7) == 0.0  # the warm start already
    assert repro.to_target(records, "train/rollouts", 0.95) == float("inf")


@pytest.mark.slow
def test_curriculum_quick(out, no_pixels):
    """Depth past the warm start's (configs/default.py's tiny one): every arm generates the same
    rollouts; the staged arm changes stage by steps, the uniform one never, the hard one draws
    only the hardest level; the table names the hardest level's key. (The gated arm differs
    from the staged one in `advance` only, which tests/test_curriculum.py covers.)"""
    repro = _load("repro_curriculum")
    argv = ["--quick", "--seeds", "0", "--out", str(out / "curr"), "--arms", "hard,uniform,staged"]
    data = repro.main([*argv, "--warm-start", str(out / "warm_default"), "--no-progress"])
    assert len({tuple(data[a]["rollouts"]) for a in ("hard", "uniform", "staged")}) == 1
    stages = {
        arm: [
            r.get("curriculum/stage")
            for r in metrics.read_jsonl(out / "curr" / arm / "seed0" / "metrics.jsonl")[1:]
        ]
        for arm in ("staged", "uniform")
    }
    assert stages == {"staged": [0, 1], "uniform": [0, 0]}, stages
    cfg = json.loads((out / "curr" / "hard" / "seed0" / "config.json").read_text())
    assert cfg["curriculum"]["stages"][0]["min_difficulty"] == 1.0
    assert cfg["data"]["max_terms"] == 5 and cfg["zve"]["max_group_size"] == 4
    text = (out / "curr" / "results.md").read_text()
    assert "`eval/pass@1/" in text and "| staged (by steps) |" in text


@pytest.mark.slow
def test_system_quick(out, no_pixels):
    """The arms switch the parts on cumulatively from the script's own warm start (its data in
    the warm start too), the reward executes a program, and the table pairs each arm's step
    time with the baseline's."""
    repro = _load("repro_system")
    argv = ["--quick", "--seeds", "0", "--out", str(out / "sys")]
    data = repro.main([*argv, "--arms", "baseline,overlap", "--no-progress"])
    for arm in ("baseline", "overlap"):
        assert all(v > 0 for v in data[arm]["step s"] + data[arm]["rollout s"]), data[arm]
        assert all(0 <= v <= 1 for v in data[arm]["idle fraction"]), data[arm]
    assert data["baseline"]["speed-up"] == [1.0]
    config = lambda run: json.loads((out / "sys" / run / "config.json").read_text())
    rollout = lambda arm: config(f"{arm}/seed0")["rollout"]
    assert (rollout("baseline")["detokenize"], rollout("baseline")["overlap_rewards"]) == (
        "host",
        False,
    )
    assert (rollout("overlap")["detokenize"], rollout("overlap")["overlap_rewards"]) == (
        "workers",
        True,
    )
    assert rollout("overlap")["schedule"] == "fifo" and not rollout("overlap")["fp8"]
    assert config("warm_start")["data"]["max_terms"] == 6  # the long-completion data
    assert config("overlap/seed0")["reward"]["function"] == "espo.data.chains:executed_reward"
    assert "| + reward overlap | " in (out / "sys" / "results.md").read_text()


@pytest.mark.slow
def test_inversion_training_quick(out, monkeypatch, no_pixels):
    """The verifier hidden: a BT RM and a pair judge trained from configs/default.py's tiny warm
    start; the RM arms score the same first rollouts with the same RM (the same pair
    accuracy), the judge arm loads the judge, no arm reads pass rates, and the table names
    each arm."""
    repro = _load("repro_inversion_training")
    argv = ["--quick", "--seeds", "0", "--arms", "naive,dead_zone,judge"]
    argv += ["--out", str(out / "inversion")]
    data = repro.main([*argv, "--warm-start", str(out / "warm_default"), "--no-progress"])
    models = data["models"]
    assert (out / "inversion" / "models" / "judge" / "reward_model.json").exists()
    assert 0 <= models["rm"]["pair_accuracy"] <= 1 and 0 <= models["judge"]["tie_accuracy"] <= 1
    assert data["naive"]["pair_accuracy"] == data["dead_zone"]["pair_accuracy"]
    assert data["naive"]["pass@1 start"] == data["judge"]["pass@1 start"]
    cfg = json.loads((out / "inversion" / "judge" / "seed0" / "config.json").read_text())
    assert cfg["reward"]["model_path"].endswith("judge") and cfg["zve"]["prefilter"] == "off"
    assert "| B/T/W judge |" in (out / "inversion" / "results.md").read_text()
    # The table again from the kept curves and the models' record beside them, without training.
    rebuilt = repro.main([*argv[:-1], str(out / "inversion_again"), "--no-progress",
                          "--records", str(out / "inversion" / "records")])  # fmt: skip
    assert rebuilt == json.loads((out / "inversion" / "results.json").read_text())
    # The models resume from what is saved: the sampled groups and the fitted RM are reused
    # (sampling or fitting again would fail here) and give the same accuracies and dead zone.
    saved = out / "inversion" / "models"
    (saved.parent / "models.json").rename(saved.parent / "models_first.json")
    shutil.rmtree(saved / "judge")
    monkeypatch.setattr(repro.Groups, "__init__", lambda *a, **k: pytest.fail("sampled again"))
    monkeypatch.setattr(
        repro.rm, "init_reward_model", lambda *a, **k: pytest.fail("fitted the RM again")
    )
    again = repro.train_models(saved.parent, out / "warm_default", "quick", seed=0)
    assert again == json.loads((saved.parent / "models_first.json").read_text())


@pytest.mark.slow
def test_testbed_quick(out):
    """The testbed's controls on configs/default.py's tiny variant: the controls from one warm
    start (the tiny default's, which the other default repros' arms share; not the arithmetic
    repros'), SFT x2 as fresh runs, a table with the 95% intervals and the warm start's majority
    vote. (The rl arm, make run's RL from that warm start, runs in test_testbed_report.py.)"""
    repro = _load("repro_testbed")
    argv = ["--quick", "--seeds", "0", "--arms", "rft,shuffled", "--out", str(out / "testbed")]
    data = repro.main([*argv, "--warm-start", str(out / "warm_default"), "--no-progress"])
    assert set(data["change"]) == {"rft", "shuffled", "sft-longer"}
    assert all(len(v) == 1 for v in data["change"].values())
    for name, ends in data["end"].items():  # change = end - the shared warm start's pass@1
        assert data["change"][name] == pytest.approx([e - data["start"] for e in ends]), name
    assert 0.0 <= data["majority"] <= 1.0
    cfg = json.loads((out / "testbed" / "sft-longer" / "seed0" / "config.json").read_text())
    assert cfg["sft"]["steps"] == 4 and cfg["train"]["steps"] == 0  # the tiny warm start's x2
    arm = json.loads((out / "testbed" / "rft" / "seed0" / "config.json").read_text())
    assert arm["advantage"]["estimator"] == "rft" and arm["data"]["source"] == "chains"
    arm = json.loads((out / "testbed" / "shuffled" / "seed0" / "config.json").read_text())
    assert arm["reward"]["shuffle"] and arm["advantage"]["estimator"] == "grpo"  # rl's else
    text = (out / "testbed" / "results.md").read_text()
    assert "| rejection-sampling FT |" in text and "majority vote" in text
    assert (out / "testbed" / "heldout.png").stat().st_size > 1000


@pytest.mark.slow
def test_make_run_seeds_quick(out, no_pixels):
    """make run over two seeds of the tiny default: a row per seed, the mean with its 95%
    interval, the same test prompts for both (data.seed), and a rerun that trains nothing."""
    repro = _load("repro_make_run")
    argv = ["--quick", "--seeds", "0,1", "--out", str(out / "make_run"), "--no-progress"]
    data = repro.main(argv)
    assert len(data["change"]) == 2 and len(data["wall_s"]) == 2
    np.testing.assert_allclose(
        data["change"], np.subtract(data["pass@1 end"], data["pass@1 start"])
    )
    text = (out / "make_run" / "results.md").read_text()
    assert "| seed 1 |" in text and "| mean ± 95% interval |" in text
    summaries = [json.loads((out / "make_run" / f"seed{s}" / "summary.json").read_text())
                 for s in (0, 1)]  # fmt: skip
    assert summaries[0]["start"]["eval/num_prompts"] == summaries[1]["start"]["eval/num_prompts"]


@pytest.mark.slow
def test_sweep_teacher_quick(out, no_pixels):
    """The teacher sweep on the tiny default: one point, the whole run with that teacher on the
    dev split, its row in the table."""
    sweep = _load("sweep_teacher")
    argv = ["--quick", "--points", "sign:0.5", "--out", str(out / "sweep"), "--no-progress"]
    data = sweep.main(argv)
    cfg = json.loads((out / "sweep" / "sign-0.5" / "seed0" / "config.json").read_text())
    assert cfg["data"]["teacher_flaw"] == "sign" and cfg["data"]["teacher_error"] == 0.5
    assert cfg["eval"]["split"] == "dev"
    row = data["sign-0.5"]
    np.testing.assert_allclose(row["change"], np.subtract(row["pass@1 end"], row["pass@1 start"]))
    assert "| sign, p=0.5 |" in (out / "sweep" / "results.md").read_text()


def test_sweep_teacher_accuracy_is_one_minus_the_dropped_negative_answers():
    """final_sign drops a negative answer's sign with probability p, so the teacher's accuracy
    is 1 - p * (the share of negative answers), counted here from the chains themselves."""
    sweep = _load("sweep_teacher")
    from espo.data import chains

    base = _load_default().get_config("")
    d = base.data
    n = 4000
    negative = sum(
        chains.draw(d.seed, i, min_terms=d.min_terms, max_terms=d.max_terms,
                    decay=d.terms_decay).answer < 0
        for i in range(n)
    ) / n  # fmt: skip
    for p in (0.0, 0.4, 1.0):
        base.data.teacher_flaw, base.data.teacher_error = "final_sign", p
        want = 1.0 - p * negative
        assert sweep.teacher_accuracy(base, n) == pytest.approx(want, abs=0.015), p
    base.data.teacher_flaw = "none"
    assert sweep.teacher_accuracy(base, 500) == 1.0


@pytest.mark.parametrize("point", ["final_sign:1.5", "typo:0.5", "sign"])
def test_sweep_teacher_rejects_a_bad_point(point, capsys):
    sweep = _load("sweep_teacher")
    with pytest.raises(SystemExit):
        sweep.main(["--points", point])
    assert "--points" in capsys.readouterr().err


def _load_default():
    return testing.load_script(ROOT / "configs" / "default.py", name="espo_default_config_test")


def test_interval_is_the_student_t_interval_by_hand():
    """[1, 2, 3]: mean 2, sample std 1, t_{0.975, 2} = 4.3027 -> half-width 4.3027 / sqrt(3)."""
    lib = _load("repro_lib")
    mean, half = lib.interval([1.0, 2.0, 3.0])
    assert mean == 2.0 and half == pytest.approx(4.302653 / 3**0.5, rel=1e-5)
    assert lib.ci([1.0, 2.0, 3.0], 2) == "2.00 ± 2.48 [-0.48, 4.48]"
    assert np.isnan(lib.interval([0.5])[1]) and lib.ci([0.5]) == "0.500"
    assert lib.interval([1.0, float("nan"), 3.0]) == pytest.approx((2.0, 12.706205))  # std sqrt(2)
    # Paired: base minus arm seed by seed ([0.1, -0.02, 0.1]: mean 0.06, sample std 0.0693).
    data = {"espo": {"area": [0.8, 0.7, 0.9]}, "grpo": {"area": [0.7, 0.72, 0.8]}}
    assert lib.paired_ci(data, "espo", "grpo", "area") == (
        "0.060 ± 0.172 [-0.112, 0.232] (2 / 3 seeds > 0)"
    )
    assert lib.paired_ci(data, "espo", "espo", "area") == ""  # the base itself
    assert lib.paired_ci(data, "gspo", "grpo", "area") == ""  # the base did not run


def test_inversion_helpers_by_hand():
    """The dead zone that classifies validation pairs best; label noise that never keeps a
    corrupted label; both orders of a pair with better <-> worse."""
    repro = _load("repro_inversion_training")
    # Ties at |gap| 0.1 and 0.3, decided pairs at 0.5 (right) and 0.2 (wrong order): a zone of
    # 0.5 classifies 3 of 4 (both ties, the 0.5 pair: |gap| >= the zone), smaller ones 1 or 2.
    gap = np.array([0.1, 0.3, 0.5, 0.2])
    tie = np.array([True, True, False, False])
    right = np.array([True, True, True, False])
    assert repro._calibrate(gap, tie, right) == 0.5
    assert repro._calibrate(np.array([1.0, 2.0]), np.array([False, False]), np.ones(2, bool)) == 0
    rng = np.random.default_rng(0)
    labels = np.repeat([0, 1], 5000)
    noisy = repro._noisy_labels(labels, rng)
    changed = noisy != labels
    assert abs(changed.mean() - repro.LABEL_NOISE) < 0.02 and set(noisy) == {0, 1, 2}
    rows = np.arange(2 * 2 * 3).reshape(2, 2, 3)
    r, m, lab = repro._both_orders(rows, rows > 0, np.array([0, 1]))
    np.testing.assert_array_equal(r[2:], rows[:, ::-1])
    np.testing.assert_array_equal(lab, [0, 1, 2, 1])


def test_system_medians_leave_out_steps_that_compiled():
    """The system table's medians: after the warm-up, not the last step (it evaluates), and no
    step that compiled; every such step compiled -> all of them rather than none."""
    repro = _load("repro_system")
    compiled = {1, 3, 6}
    recs = [{"step": 0}] + [
        {"step": s, "perf/compiles": 4.0 if s in compiled else 0.0, "x": float(s)}
        for s in range(1, 9)
    ]
    assert [r["step"] for r in repro._timed(recs)] == [4, 5, 7]
    assert repro._median(recs, "x") == 5.0
    every = [{"step": s, "perf/compiles": 1.0} for s in range(1, 6)]
    assert [r["step"] for r in repro._timed(every)] == [3, 4]
