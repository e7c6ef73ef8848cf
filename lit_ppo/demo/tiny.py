"""A tiny Qwen2-architecture model and a character tokenizer, built locally (no hub).

The embedded default experiment trains this model; it has the same architecture as
Qwen2.5 so the same loading, training and vLLM code paths run as for a real model.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [PAD_TOKEN, EOS_TOKEN, "<|im_start|>", "<|im_end|>"]
# Chat template in Qwen's shape, so chat-formatted prompts work with the tiny tokenizer too.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


TOKENIZER_VERSION = 2  # part of the cache key of models built with it
CHARS = [c for c in string.printable if c not in "\r\x0b\x0c"]


def padded_vocab_size(tokens: int) -> int:
    return 64 * ((tokens + 63) // 64)  # padded like real vocabularies


def tiny_vocab_size() -> int:
    """The tiny model's vocabulary size, without building the tokenizer (for the memory estimate)."""
    return padded_vocab_size(len(SPECIAL_TOKENS) + len(CHARS))


def _byte_level_symbol(char: str) -> str:
    """GPT-2's byte-to-unicode map for ASCII: printable characters stand for themselves, bytes 0-32 move to 256+."""
    code = ord(char)
    return char if 33 <= code <= 126 else chr(256 + code)


def build_char_tokenizer(vocab_size: int | None = None) -> PreTrainedTokenizerFast:
    """One token per printable ASCII character, plus Qwen-style special tokens.

    It is a byte-level BPE without merges, the same pipeline as Qwen2's tokenizer, so loading the
    saved directory with AutoTokenizer (which picks Qwen2Tokenizer from config.json) and with vLLM
    gives exactly the same ids, spaces and newlines included.

    `vocab_size`: the vocabulary filled up to this many tokens (e.g. Qwen2.5's 151,936) with word tokens ` w0`,
    ` w1`, ... after the characters: text still encodes one token per character (there are no merges), and every id
    a model of that vocabulary samples decodes to text, so a random-weight model of a real model's shape generates,
    decodes and is rewarded like one."""
    base = SPECIAL_TOKENS + [_byte_level_symbol(c) for c in CHARS]
    if vocab_size is not None and vocab_size < len(base):
        raise ValueError(f"build_char_tokenizer: vocab_size={vocab_size} is below the {len(base)} base tokens")
    fillers = [f"{_byte_level_symbol(' ')}w{i}" for i in range((vocab_size or len(base)) - len(base))]
    vocab = {tok: i for i, tok in enumerate(base + fillers)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False))
    core.add_special_tokens(SPECIAL_TOKENS)
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, padding_side="right"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_config(
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    max_position_embeddings: int,
    tie_word_embeddings: bool = True,
) -> Qwen2Config:
    """The tiny model's config (`model.tiny`'s shape), what its config.json will say. `tie_word_embeddings=False`:
    an LM head of its own, as the larger Qwen2.5 models (7B and up) have."""
    vocab_size = padded_vocab_size(len(tokenizer))
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id,
        torch_dtype="float32",
    )


def build_tiny_model(tokenizer: PreTrainedTokenizerFast, *, seed: int, **shape):
    """The tiny model of `tiny_config(tokenizer, **shape)` with the random weights of `seed`."""
    config = tiny_config(tokenizer, **shape)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def save_model_dir(model, tokenizer, path: str | Path) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
