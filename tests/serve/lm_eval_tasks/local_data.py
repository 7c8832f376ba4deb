"""The tasks' documents: a JSON-lines file beside this one, as the `test` split (the
tasks' `custom_dataset`; nothing is downloaded or cached)."""

import json
from pathlib import Path

import datasets


def load(data_file: str, **_) -> dict[str, datasets.Dataset]:
    """{"test": the rows of `data_file`}; lm-eval passes its metadata as more kwargs."""
    lines = (Path(__file__).parent / data_file).read_text(encoding="utf-8").splitlines()
    return {"test": datasets.Dataset.from_list([json.loads(line) for line in lines])}
