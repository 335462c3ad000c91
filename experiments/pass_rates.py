"""Offline pass rates of a run's training prompts (`espo.pass_rates`), before RL.

  python experiments/pass_rates.py --config configs/default.py \\
      --config.model.init_from=runs/warm --samples 16 --out runs/pass_rates.json

Samples --samples completions of every training prompt (the first --max_prompts; 0: all) with
the policy the config's run starts RL from, scores them with its verifier and writes the table
that `--config.zve.pass_rate_table` reads. Rerunning the same command resumes the estimate.
"""

from __future__ import annotations

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from espo import errors, pass_rates

_CONFIG = config_flags.DEFINE_config_file("config", "configs/default.py", "Run configuration.")
_OUT = flags.DEFINE_string("out", None, "The table's JSON file.", required=True)
_SAMPLES = flags.DEFINE_integer("samples", 16, "Samples of each prompt.")
_MAX_PROMPTS = flags.DEFINE_integer("max_prompts", 0, "Training prompts estimated; 0: all.")


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    try:
        table = pass_rates.estimate(
            _CONFIG.value, num_samples=_SAMPLES.value, max_prompts=_MAX_PROMPTS.value,
            out=_OUT.value, progress=True,
        )  # fmt: skip
    except (errors.InvalidValue, FileExistsError) as e:  # a config value or another's table
        sys.exit(f"{getattr(e, 'kind', 'error')}: {e}")
    rates = list(table.pass_rates.values())
    print(f"{_OUT.value}: {len(rates)} prompts, mean pass rate {sum(rates) / len(rates):.3f}")


if __name__ == "__main__":
    app.run(main)
