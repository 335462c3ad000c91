"""`experiments/run.py`, its end-of-run plots laid out but not drawn: for the tests that run the
command in a subprocess and read no picture (tests/test_trainer.py: kill -9 and rerun, two JAX
processes). As conftest's `_plots_without_pixels` does in the pytest process, `espo.plots`
still reads every panel's series of the run's metrics and writes one (empty) file per panel;
the pixels are tested in tests/test_plots.py and on test_trainer's `straight` run. Same flags
as run.py:

  python tests/run_without_pixels.py --config configs/default.py:tiny --workdir /tmp/run
"""

import pathlib
import runpy
import sys

from espo import plots, testing

RUN = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "run.py"


if __name__ == "__main__":
    plots._draw = testing.draw_without_pixels
    sys.argv[0], sys.path[0] = str(RUN), str(RUN.parent)  # as `python experiments/run.py`
    runpy.run_path(str(RUN), run_name="__main__")
