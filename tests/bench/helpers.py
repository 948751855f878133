"""A tiny model saved with a word-level tokenizer, for the benchmark's command line and prompt encoding."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tests.conftest import TINY_VOCAB, tiny_llama

WORDS = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(TINY_VOCAB - 3)]


def save_tiny_model(directory: Path) -> None:
    """A tiny LLaMA plus a whitespace word-level tokenizer over its 64 ids, with a trivial chat template."""
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = (
        "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w1{% endif %}"
    )
    fast.save_pretrained(directory)
    tiny_llama(seed=5).save_pretrained(directory)
