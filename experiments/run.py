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

from espo import checkpoint, trainer
from espo import config as config_lib
from espo.data import sources
from espo.model import hf

_CONFIG = config_flags.DEFINE_config_file("config", "configs/default.py", "Run configuration.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory; overrides config.workdir.")


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    try:
        trainer.train(_CONFIG.value, _WORKDIR.value)
    except config_lib.ConfigError as e:
        sys.exit(f"config error: {e}")
    except sources.BadRecordError as e:  # a malformed data file: the file, the line, the field
        sys.exit(f"data error: {e}")
    except (checkpoint.CheckpointMismatchError, hf.CheckpointError) as e:  # workdir / HF dir
        sys.exit(f"checkpoint error: {e}")
    except FileNotFoundError as e:  # a path the config names (data file, checkpoint dir files)
        sys.exit(f"missing file: {e}")


if __name__ == "__main__":
    app.run(main)
