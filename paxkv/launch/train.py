"""Trains the tiny byte-level model on the Python standard library and saves it with orbax.

    paxkv-train                                  # writes the bundled tiny-py checkpoint
    paxkv-train --out_dir=/tmp/tiny_py --steps=200

The corpus is this interpreter's standard library sources, 5% of the files held out
(see `paxkv.models.training`). The result loads as `load_model("tiny-py")` when written to the
default `--out_dir`, and as `load_model(<out_dir>)` anywhere.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys

from absl import flags, logging

from paxkv.launch import define_seed, exit_with_error, list_in_help, platform, run_app
from paxkv.models import (
    CHECKPOINTS,
    CONFIG_FILE,
    ORBAX_PARAMS_DIR,
    init_model,
    save_params,
    training,
)
from paxkv.models.llama_config import TINY
from paxkv.models.tokenizer import write_byte_tokenizer

_DEFAULTS = training.TrainConfig()
_OUT_DIR = flags.DEFINE_string(
    "out_dir", CHECKPOINTS["tiny-py"], "Checkpoint directory (config.json and orbax params/)."
)
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace a checkpoint already in --out_dir.")
_STEPS = flags.DEFINE_integer("steps", _DEFAULTS.steps, "Optimizer steps.", lower_bound=1)
_BATCH_SIZE = flags.DEFINE_integer(
    "batch_size", _DEFAULTS.batch_size, "Windows per step.", lower_bound=1
)
_SEQ_LEN = flags.DEFINE_integer(
    "seq_len", _DEFAULTS.seq_len, "Bytes the model reads per window.", lower_bound=2
)
_LEARNING_RATE = flags.DEFINE_float(
    "learning_rate", _DEFAULTS.learning_rate, "Peak learning rate of the cosine schedule."
)
_WARMUP_STEPS = flags.DEFINE_integer(
    "warmup_steps", _DEFAULTS.warmup_steps, "Linear warmup steps.", lower_bound=0
)
_SEED = define_seed(_DEFAULTS.seed, "Seed of the initialisation and the batches.")
_LOG_EVERY = flags.DEFINE_integer(
    "log_every", _DEFAULTS.log_every, "Steps between progress log lines.", lower_bound=1
)

TRAINING_FILE = "training.json"  # what produced the checkpoint, beside it


def main(argv: list[str]) -> None:
    """The absl main: trains the tiny-py model and writes its checkpoint."""
    if len(argv) > 1:
        exit_with_error(f"unexpected arguments {argv[1:]}")
    out_dir = os.path.abspath(_OUT_DIR.value)
    params_dir = os.path.join(out_dir, ORBAX_PARAMS_DIR)
    if os.path.exists(params_dir) and not _OVERWRITE.value:
        exit_with_error(f"{out_dir} already holds a checkpoint: pass --overwrite to replace it")
    try:
        platform.require_platform()
        platform.announce("paxkv-train", None)
        config = training.TrainConfig(
            steps=_STEPS.value,
            batch_size=_BATCH_SIZE.value,
            seq_len=_SEQ_LEN.value,
            learning_rate=_LEARNING_RATE.value,
            warmup_steps=_WARMUP_STEPS.value,
            seed=_SEED.value,
            log_every=_LOG_EVERY.value,
        )
        train_data, eval_data = training.load_corpus("train"), training.load_corpus("eval")
    except (ValueError, OSError) as e:
        exit_with_error(str(e))
    logging.info(
        "corpus %s: %d train bytes, %d held-out bytes",
        training.stdlib_root(),
        len(train_data),
        len(eval_data),
    )
    model = init_model(TINY, config.seed)
    result = training.train(model, train_data, config, eval_data=eval_data)
    if os.path.exists(params_dir):
        shutil.rmtree(params_dir)
    save_params(model, out_dir)
    write_byte_tokenizer(out_dir)  # its tokenizer files and chat template
    record = {
        "model": "tiny",
        "config": dataclasses.asdict(config),
        "python": sys.version.split()[0],
        "train_bytes": len(train_data),
        "eval_bytes": len(eval_data),
        "seconds": result.seconds,
        "tokens": result.tokens,
        "losses": result.losses,
        "eval_bits_per_byte": result.eval_loss / math.log(2),
    }
    with open(os.path.join(out_dir, TRAINING_FILE), "w") as f:
        json.dump(record, f, indent=2)
    size = sum(
        os.path.getsize(os.path.join(d, name)) for d, _, names in os.walk(out_dir) for name in names
    )
    print(
        f"trained {config.steps} steps ({result.tokens} tokens) in {result.seconds:.0f} s; "
        f"held-out {record['eval_bits_per_byte']:.3f} bits/byte; "
        f"saved {out_dir} ({size / 2**20:.2f} MiB, {CONFIG_FILE} + {ORBAX_PARAMS_DIR}/)"
    )


def run() -> None:
    """Console-script entry point (`paxkv-train`)."""
    list_in_help(__name__, __doc__)
    run_app(main)


if __name__ == "__main__":
    run()
