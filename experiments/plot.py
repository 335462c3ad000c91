"""Curves of a run: `python experiments/plot.py WORKDIR` writes WORKDIR/plots/*.png.

Reads WORKDIR/metrics.jsonl (also while the run is still going) and prints the PNG paths.
"""

from __future__ import annotations

import argparse
import sys

from espo import plots


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdir", help="a run's workdir (holds metrics.jsonl)")
    args = parser.parse_args(argv)
    try:
        paths = plots.plot_run(args.workdir)
    except (FileNotFoundError, ValueError) as e:
        print(f"plot.py: {e}", file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
