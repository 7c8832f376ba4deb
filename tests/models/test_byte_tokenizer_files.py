"""tiny-py's tokenizer files: paxkv reads its `ByteTokenizer`, and other programs read
the shipped `tokenizer.json` (transformers' `AutoTokenizer`, as lm-eval's `huggingface`
tokenizer backend does) to the same ids, text and chat prompt."""

import json
from pathlib import Path

import numpy as np
import pytest

from paxkv.models import CHECKPOINTS
from paxkv.models.tokenizer import ByteTokenizer, write_byte_tokenizer

TEXTS = ["héllo wörld € 😀 日本語", "def f(x):\n\treturn  x  # ok\r\n", " leading", ""]


def test_the_shipped_files_are_what_paxkv_train_writes(tmp_path):
    write_byte_tokenizer(str(tmp_path))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shipped = Path(CHECKPOINTS["tiny-py"], name).read_text(encoding="utf-8")
        assert (tmp_path / name).read_text(encoding="utf-8") == shipped, name


def test_transformers_reads_the_byte_tokens():
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(CHECKPOINTS["tiny-py"])
    ours = ByteTokenizer()
    rng = np.random.default_rng(0)
    texts = [*TEXTS, bytes(rng.integers(32, 127, 200).tolist()).decode()]
    for text in texts:
        ids = hf(text, add_special_tokens=True)["input_ids"]
        assert ids == ours.encode(text) == list(text.encode()), text
        assert hf.decode(ids) == ours.decode(ids) == text
    assert hf.decode([0xE2, 0x82]) == ours.decode([0xE2, 0x82])  # a cut character
    chat = [{"role": "user", "content": "hi"}]
    rendered = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    template = json.loads(Path(CHECKPOINTS["tiny-py"], "tokenizer_config.json").read_text())
    assert rendered == "# user: hi\n# assistant:\n" and "chat_template" in template


def test_paxkv_loads_its_byte_tokenizer():
    from paxkv.models import load_model

    _, _, tokenizer = load_model("tiny-py")
    assert isinstance(tokenizer, ByteTokenizer)
