"""A small byte-level BPE tokenizer for the tests of text streams (detokenizer, outputs)."""

import pytest

from paxkv.models import HFTokenizer

TEXT = "héllo wörld € 😀 日本語 naïve: ok"


def bpe_tokenizer(text: str = TEXT) -> HFTokenizer:
    """A byte-level BPE of 300 tokens (specials 0 and 1) trained on `text`, whose
    tokens split multi-byte characters (as GPT-2's do)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text] * 4, trainer)
    return HFTokenizer(tok)
