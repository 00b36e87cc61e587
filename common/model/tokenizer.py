"""The embedded byte-level tokenizer, built in code (no hub, no files).

Token ids 0-255 are the raw UTF-8 bytes, so any text round-trips exactly; ids 256-259 are special
tokens. It is a real Hugging Face fast tokenizer (``tokenizers`` BPE with no merges over the
byte-level alphabet), so ``save_pretrained`` / ``AutoTokenizer.from_pretrained`` round-trip it and a
checkpoint directory written with it loads like any other.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END, PAD_TOKEN)  # ids 256, 257, 258, 259
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

# ChatML, the same shape as Qwen's template.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """Build the byte-level tokenizer: 260 ids, EOS ``<|endoftext|>`` = 256, left padding, ChatML template."""
    byte_to_char = bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, padding_side="left"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast
