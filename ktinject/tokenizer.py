"""A byte-level tokenizer the project builds deterministically (no download).

Token ids 0..2 are `<pad>`, `<s>`, `</s>`; ids 3..258 are the 256 bytes (GPT-2 byte-to-
unicode alphabet, so every string round-trips). It is the tokenizer of the built-in default
model and of the tiny test models; real models bring their own.
"""
from __future__ import annotations

SPECIALS = ("<pad>", "<s>", "</s>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def byte_tokenizer(vocab_size: int = 512):
    """A `PreTrainedTokenizerFast` over bytes; `vocab_size` must leave room for 259 tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if vocab_size < len(SPECIALS) + 256:
        raise ValueError(f"a byte tokenizer needs vocab_size >= {len(SPECIALS) + 256}, got {vocab_size}")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda ch: _byte_of(ch))
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in byte_chars:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _byte_of(ch: str) -> int:
    # Inverse of GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to 256+.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    code = ord(ch)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]
