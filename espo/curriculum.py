"""The multi-stage difficulty curriculum (Compass-Thinker-7B): which prompts, G and budget per step.

Owns the schedule of `config.curriculum.stages`. Each `Stage` has a difficulty range (difficulty =
1 - pass rate, in [0, 1]), an optional window on the online pass-rate history, its own group size
G and generation budget, and an advance rule. `Curriculum` is a pure, immutable description;
the changing part is the small `CurriculumState` (stage index, steps done in it, accuracy EMA),
which the trainer carries and checkpoints (`state_dict` / `from_state_dict`).

Per step: `stage(state)` -> prompts filtered by `accepts(state, difficulty, pass_rate)` ->
rollout with the stage's G and max_new_tokens -> `update(state, train_accuracy=...)` -> new state.

Invariants:
- Stages are visited in order, one advance at most per step; the last stage never advances.
- On an advance the new stage starts with steps_in_stage = 0 and no accuracy EMA (the old
  stage's accuracy says nothing about harder prompts).
- The EMA starts at the first accuracy of the stage (no zero-initialisation bias), then
  ema <- decay * ema + (1 - decay) * accuracy.

The paper gives no stage count, difficulty bins or schedule (see docs/formulas.md §3);
the defaults here and in the configs are our own choice.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from espo import errors

ADVANCE_RULES = ("steps", "accuracy")


_is_int, _is_number = errors.is_int, errors.is_real


def _unit(v) -> bool:
    return _is_number(v) and 0.0 <= v <= 1.0


def _stage_rules(s: Stage) -> dict[str, tuple]:
    """field -> (is it valid, what would be valid) of `s`, in field order (`errors.check`)."""
    return {
        "name": (isinstance(s.name, str) and bool(s.name), "a non-empty string"),
        "min_difficulty": (_unit(s.min_difficulty), "a number in [0, 1]"),
        "max_difficulty": (
            lambda: _unit(s.max_difficulty) and s.max_difficulty >= s.min_difficulty,
            f"a number in [min_difficulty={s.min_difficulty!r}, 1]",
        ),
        "pass_rate_low": (
            s.pass_rate_low is None or _unit(s.pass_rate_low), "None or a number in [0, 1]"
        ),
        "pass_rate_high": (
            lambda: s.pass_rate_high is None
            or (
                _unit(s.pass_rate_high)
                and (s.pass_rate_low is None or s.pass_rate_high >= s.pass_rate_low)
            ),
            f"None or a number in [pass_rate_low={s.pass_rate_low!r}, 1]",
        ),
        "group_size": (_is_int(s.group_size) and s.group_size >= 1, "an int >= 1"),
        "max_new_tokens": (_is_int(s.max_new_tokens) and s.max_new_tokens >= 1, "an int >= 1"),
        "advance": (s.advance in ADVANCE_RULES, f"one of {ADVANCE_RULES}"),
        "steps": (_is_int(s.steps) and s.steps >= 1, "an int >= 1"),
        "accuracy_threshold": (_unit(s.accuracy_threshold), "a number in [0, 1]"),
        "min_steps": (
            lambda: _is_int(s.min_steps) and 1 <= s.min_steps <= s.steps,
            f"an int in [1, steps={s.steps!r}]",
        ),
        "ema": (_is_number(s.ema) and 0.0 <= s.ema < 1.0, "a number in [0, 1) (the EMA decay)"),
    }  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stage:
    """One curriculum stage (all bounds inclusive)."""

    name: str  # shown in logs
    min_difficulty: float = 0.0  # prompts with difficulty in [min, max]; NaN (unknown): accepted
    max_difficulty: float = 1.0
    pass_rate_low: float | None = None  # window on the online pass-rate history; None: open
    pass_rate_high: float | None = None
    group_size: int = 8  # G of this stage (the ZVE adaptive G may raise it)
    max_new_tokens: int = 64  # generation budget of this stage
    advance: str = "steps"  # "steps" or "accuracy" (see `Curriculum.update`)
    steps: int = 100  # "steps": steps in this stage; "accuracy": the cap
    accuracy_threshold: float = 0.8  # "accuracy": advance once the EMA reaches it ...
    min_steps: int = 1  # ... after at least this many steps
    ema: float = 0.9  # decay of the training-accuracy EMA

    def __post_init__(self):
        errors.check(self, _stage_rules(self))


@dataclasses.dataclass(frozen=True, kw_only=True)
class CurriculumState:
    """Where the run is in the curriculum (host state, checkpointed)."""

    stage: int = 0  # index into Curriculum.stages
    steps_in_stage: int = 0  # steps finished in the current stage
    accuracy_ema: float | None = None  # EMA of training accuracy in this stage; None: no step yet

    def __post_init__(self):
        checks = {
            "stage": (_is_int(self.stage) and self.stage >= 0, "an int >= 0"),
            "steps_in_stage": (
                _is_int(self.steps_in_stage) and self.steps_in_stage >= 0,
                "an int >= 0",
            ),
            "accuracy_ema": (
                self.accuracy_ema is None
                or (_is_number(self.accuracy_ema) and 0.0 <= self.accuracy_ema <= 1.0),
                "None or a number in [0, 1]",
            ),
        }
        errors.check(self, checks)

    def state_dict(self) -> dict:
        """Plain Python values (JSON-serialisable; accuracy_ema may be None)."""
        ema = None if self.accuracy_ema is None else float(self.accuracy_ema)
        return dict(
            stage=int(self.stage), steps_in_stage=int(self.steps_in_stage), accuracy_ema=ema
        )

    @classmethod
    def from_state_dict(cls, d: Mapping) -> CurriculumState:
        """Inverse of `state_dict`; numpy scalars (as restored by orbax) are accepted."""
        fields = [f.name for f in dataclasses.fields(cls)]
        if set(d) != set(fields):
            raise errors.InvalidValue(
                "curriculum", "state", valid=f"a dict with keys {fields}; got {sorted(d)}"
            )
        ema = d["accuracy_ema"]
        ema = None if ema is None else _as_float(ema)
        return cls(
            stage=_as_int(d["stage"]), steps_in_stage=_as_int(d["steps_in_stage"]), accuracy_ema=ema
        )


def _as_int(value):
    """An int from an int-like (numpy scalar / 0-d array); other values pass through to fail."""
    try:
        if not isinstance(value, bool | float | str) and int(value) == value:
            return int(value)
    except (TypeError, ValueError):
        pass
    return value


def _as_float(value):
    """A float from a number-like; None for NaN (how some checkpoint formats store None)."""
    if isinstance(value, bool | str):
        return value  # fails validation
    try:
        out = float(value)
    except (TypeError, ValueError):
        return value
    return None if math.isnan(out) else out


class Curriculum:
    """An ordered, validated list of `Stage`s and the rules that move through them."""

    def __init__(self, stages: Sequence[Stage]):
        stages = tuple(stages)
        if not stages:
            raise errors.InvalidValue("curriculum", "stages", (), "at least one stage")
        for i, stage in enumerate(stages):
            if not isinstance(stage, Stage):  # a Stage validated its fields when it was built
                raise errors.InvalidValue("curriculum", f"stages[{i}]", stage, "a curriculum.Stage")
        self.stages: tuple[Stage, ...] = stages

    @classmethod
    def from_config(cls, stages: Sequence[Mapping]) -> Curriculum:
        """From `config.curriculum.stages`: a list of dicts (or ConfigDicts) of `Stage` fields."""
        if isinstance(stages, str | Mapping) or not isinstance(stages, Sequence):
            raise errors.InvalidValue(
                "curriculum", "stages", stages, f"a list of dicts with keys {_STAGE_KEYS}"
            )
        built = []
        for i, entry in enumerate(stages):
            where = f"curriculum.stages[{i}]"
            if hasattr(entry, "to_dict"):  # ml_collections.ConfigDict is not a Mapping
                entry = entry.to_dict()
            if not isinstance(entry, Mapping):
                raise errors.InvalidValue(
                    "curriculum", f"stages[{i}]", entry, f"a dict with keys {_STAGE_KEYS}"
                )
            unknown = sorted(set(entry) - set(_STAGE_KEYS))
            if unknown:
                raise errors.InvalidValue(where, unknown[0], valid=f"one of the keys {_STAGE_KEYS}")
            if "name" not in entry:
                raise errors.InvalidValue(where, "name", valid="present: every stage has a name")
            try:
                built.append(Stage(**entry))
            except errors.InvalidValue as e:
                raise e.moved(where) from None
        return cls(built)

    def __repr__(self) -> str:
        return f"Curriculum({list(self.stages)!r})"

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def max_new_tokens(self) -> int:
        """The largest generation budget of any stage (sizes the compiled buffers)."""
        return max(s.max_new_tokens for s in self.stages)

    @property
    def max_group_size(self) -> int:
        """The largest G of any stage (before any ZVE adaptive increase)."""
        return max(s.group_size for s in self.stages)

    def stage(self, state: CurriculumState) -> Stage:
        """The stage `state` is in (an error if it does not fit this curriculum)."""
        if not 0 <= state.stage < len(self.stages):
            raise errors.InvalidValue(
                "CurriculumState", "stage", state.stage,
                f"in [0, {len(self.stages) - 1}] for a curriculum of {len(self.stages)} stage(s) "
                "(did the config's curriculum.stages change since the checkpoint?)",
            )  # fmt: skip
        return self.stages[state.stage]

    def accepts(
        self, state: CurriculumState, difficulty: float, pass_rate: float | None = None
    ) -> bool:
        """Whether the current stage trains on a prompt (all bounds inclusive).

        difficulty: 1 - pre-filter pass rate in [0, 1]; NaN (unknown) is accepted by every stage.
        pass_rate: the prompt's online pass rate from the history; None (never seen) is accepted.
        """
        s = self.stage(state)
        d = float(difficulty)
        if not math.isnan(d) and not s.min_difficulty <= d <= s.max_difficulty:
            return False
        if pass_rate is None:
            return True
        p = float(pass_rate)
        if s.pass_rate_low is not None and not p >= s.pass_rate_low:
            return False
        return s.pass_rate_high is None or p <= s.pass_rate_high

    def update(
        self, state: CurriculumState, *, train_accuracy: float
    ) -> tuple[CurriculumState, dict[str, float]]:
        """One training step of the current stage is done: the next state and its metrics.

        Advance rules (the last stage never advances):
          "steps":    after `steps` steps in the stage;
          "accuracy": once the accuracy EMA >= accuracy_threshold with at least `min_steps`
                      steps done, or after `steps` steps (a cap).
        The metrics describe the step just done: the stage it trained in, the steps done in that
        stage including this one, the EMA after this step, and "curriculum/advanced" = 1.0 when
        the next step starts a new stage.
        """
        s = self.stage(state)
        acc = float(train_accuracy)
        if not 0.0 <= acc <= 1.0:  # also rejects NaN
            raise errors.InvalidValue("", "train_accuracy", train_accuracy, "a number in [0, 1]")
        ema = acc if state.accuracy_ema is None else s.ema * state.accuracy_ema + (1 - s.ema) * acc
        ema = min(max(ema, 0.0), 1.0)  # float rounding must not leave [0, 1]
        steps = state.steps_in_stage + 1
        last = state.stage == len(self.stages) - 1
        if s.advance == "steps":
            advance = steps >= s.steps
        else:
            advance = steps >= s.steps or (steps >= s.min_steps and ema >= s.accuracy_threshold)
        advance = advance and not last
        metrics = {
            "curriculum/stage": float(state.stage),
            "curriculum/steps_in_stage": float(steps),
            "curriculum/accuracy_ema": float(ema),
            "curriculum/advanced": float(advance),
        }
        if advance:
            return CurriculumState(stage=state.stage + 1), metrics
        return CurriculumState(stage=state.stage, steps_in_stage=steps, accuracy_ema=ema), metrics


_STAGE_KEYS = [f.name for f in dataclasses.fields(Stage)]
