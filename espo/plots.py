"""PNG curves of a run from its `metrics.jsonl`: `plot_run(workdir)` -> `WORKDIR/plots/*.png`.

Owns `WORKDIR/plots/`. One PNG per panel (`PANELS`: train reward/accuracy, held-out eval, loss
and clip fraction, ZVE rates, train-inference mismatch, entropy, curriculum, time per phase)
plus `other.png` for metrics no panel claims. In a panel, the metrics matching one of its
`together` patterns share an axes; every other metric gets its own. A panel none of whose
metrics is in the file is skipped. Steps where a metric is absent or null (non-finite, see
`espo.metrics`) are gaps, so evaluation metrics appear as points at the evaluation steps.

Figures are drawn with `matplotlib.figure.Figure` and the Agg canvas, never pyplot: importing
this module changes no global backend and works without a display.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import re

from matplotlib import figure as mpl_figure
from matplotlib.backends import backend_agg

from espo import metrics as metrics_lib

PLOTS_DIR = "plots"
_MARKER_MAX_POINTS = 60  # up to this many points a curve also marks each point
_AXES_W, _AXES_H = 4.6, 3.2  # inches a figure gives each axes


@dataclasses.dataclass(frozen=True, kw_only=True)
class Panel:
    """One PNG: the metrics whose name matches `match` (re.search)."""

    name: str  # file stem
    title: str
    match: str
    together: tuple[tuple[str, str], ...] = ()  # (axes title, pattern): matches share one axes

    def __post_init__(self):
        if not re.fullmatch(r"[a-z0-9_]+", self.name):
            raise ValueError(f"Panel.name must match [a-z0-9_]+, got {self.name!r}")
        for pattern in (self.match, *(p for _, p in self.together)):
            re.compile(pattern)


PANELS: tuple[Panel, ...] = (
    Panel(
        name="train",
        title="Training reward and accuracy",
        match=r"^train/",
        together=(("reward", r"^train/reward"), ("accuracy", r"^train/acc")),
    ),
    Panel(
        name="eval",
        title="Held-out evaluation",
        match=r"^eval/",
        together=(("pass@1 and avg@k", r"^eval/(pass|avg)@"),),
    ),
    Panel(name="loss", title="Loss and clip fraction", match=r"^loss/"),
    Panel(
        name="zve",
        title="Zero-variance elimination",
        match=r"^zve/",
        together=(("rates", r"(rate|frac)"),),
    ),
    Panel(name="mismatch", title="Train-inference mismatch", match=r"^mismatch/"),
    Panel(name="entropy", title="Entropy", match=r"entropy", together=(("entropy", r"entropy"),)),
    Panel(name="curriculum", title="Curriculum", match=r"^curriculum/"),
    Panel(
        name="perf",
        title="Time per step and phase",
        match=r"^perf/",
        together=(("seconds per step", r"(?<!_per)_s$"),),  # not tokens_per_s
    ),
)


Series = tuple[list[int], list[float]]


def collect_series(records: list[dict]) -> dict[str, Series]:
    """metric -> (steps, values) over the steps where it is a finite number, in step order."""
    out: dict[str, Series] = {}
    for record in sorted(records, key=lambda r: r["step"]):
        for key, value in record.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if math.isfinite(value):
                steps, values = out.setdefault(key, ([], []))
                steps.append(record["step"])
                values.append(float(value))
    return out


def layout(keys: list[str]) -> list[tuple[str, list[tuple[str, list[str]]]]]:
    """[(panel name, [(axes title, [metric, ...]), ...]), ...] for the metrics in `keys`.

    Panels and metrics keep the order of `PANELS` and sorted names; empty panels are left out.
    """
    keys = sorted(keys)
    claimed: set[str] = set()
    out = []
    other = Panel(name="other", title="Other metrics", match=r".")
    for panel in (*PANELS, other):
        mine = [k for k in keys if re.search(panel.match, k)]
        if panel is other:
            mine = [k for k in mine if k not in claimed]
        claimed.update(mine)
        axes: list[tuple[str, list[str]]] = []
        for title, pattern in panel.together:
            shared = [k for k in mine if re.search(pattern, k)]
            if shared:
                axes.append((title, shared))
        grouped = {k for _, ks in axes for k in ks}
        axes.extend((k, [k]) for k in mine if k not in grouped)
        if axes:
            out.append((panel.name, axes))
    return out


def _title(name: str) -> str:
    return next((p.title for p in PANELS if p.name == name), "Other metrics")


def _draw(
    path: pathlib.Path, title: str, axes_spec: list[tuple[str, list[str]]], series: dict
) -> None:
    ncols = min(3, len(axes_spec))
    nrows = math.ceil(len(axes_spec) / ncols)
    width, height = _AXES_W * ncols, _AXES_H * nrows + 0.4
    fig = mpl_figure.Figure(figsize=(width, height))
    backend_agg.FigureCanvasAgg(fig)
    # Fixed margins in inches (tick labels, titles, the suptitle) rather than constrained layout,
    # which measured every tick label's box: half the drawing time of a run's ~100 panels.
    margins = dict(left=0.75 / width, right=1 - 0.15 / width, bottom=0.5 / height)
    grid = fig.subplots(
        nrows, ncols, squeeze=False,
        gridspec_kw=dict(**margins, top=1 - 0.75 / height, wspace=0.3, hspace=0.55),
    )  # fmt: skip
    for ax, (ax_title, keys) in zip(grid.flat, axes_spec, strict=False):
        for key in keys:
            steps, values = series[key]
            marker = "o" if len(steps) <= _MARKER_MAX_POINTS else None
            ax.plot(steps, values, marker=marker, markersize=3, linewidth=1.2, label=key)
        ax.set_title(ax_title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(keys) > 1 or ax_title != keys[0]:
            ax.legend(fontsize=8)
    for ax in grid.flat[len(axes_spec) :]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.savefig(path, dpi=100)


def plot_run(workdir: str | os.PathLike) -> list[pathlib.Path]:
    """Writes WORKDIR/plots/<panel>.png from WORKDIR/metrics.jsonl; returns the files written."""
    workdir = pathlib.Path(workdir)
    path = workdir / metrics_lib.METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file {path}: is {workdir} the workdir of a run?")
    records = metrics_lib.read_jsonl(path)
    series = collect_series(records)
    if not series:
        raise ValueError(
            f"{path} has no metric values to plot ({len(records)} records, all empty or null)"
        )
    out_dir = workdir / PLOTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, axes_spec in layout(list(series)):
        png = out_dir / f"{name}.png"
        _draw(png, _title(name), axes_spec, series)
        written.append(png)
    return written
