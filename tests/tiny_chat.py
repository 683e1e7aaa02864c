"""A tiny word-level tokenizer with a chat template, built in the test (nothing downloaded)."""

from __future__ import annotations

ROLES = ("<|system|>", "<|user|>", "<|assistant|>")
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def chat_tokenizer(vocab_size: int = 96):
    """ids 0-2 pad/bos/eos, 3-5 the role markers, then words w0, w1, ... up to ``vocab_size``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", *ROLES]
    words += [f"w{i}" for i in range(vocab_size - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", additional_special_tokens=list(ROLES))
    fast.chat_template = TEMPLATE
    return fast
