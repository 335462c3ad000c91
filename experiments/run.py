"""espo's entry point: `python experiments/run.py --config configs/<name>.py[:variant]`.

Trains (or resumes) the RL run the config describes; `espo.trainer.train` does the work.

  python experiments/run.py --config configs/default.py
  python experiments/run.py --config configs/default.py:tiny --workdir /tmp/espo_tiny
  python experiments/run.py --config configs/default.py --config.loss.name=grpo
  python experiments/run.py --config configs/qwen3_moe.py --config.model.hf_path=/ckpt/Qwen3-MoE \\
      --config.data.path=/data/math.jsonl

Config fields are overridden with `--config.<section>.<field>=<value>`; the config is locked, so
a misspelt key fails at once naming the closest valid one, and a bad value fails before anything
compiles naming the key and what is valid; a malformed data file, a workdir holding another run
or a bad Hugging Face directory is one line too (no traceback). Rerunning the same command resumes
from the newest checkpoint in the workdir.
"""

from __future__ import annotations

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from espo import errors, trainer

_CONFIG = config_flags.DEFINE_config_file("config", "configs/default.py", "Run configuration.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory; overrides config.workdir.")


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    try:
        trainer.train(_CONFIG.value, _WORKDIR.value)
    except errors.InvalidValue as e:  # a config value, data file or checkpoint: one line
        sys.exit(f"{e.kind}: {e}")


if __name__ == "__main__":
    app.run(main)
