"""Tiny tokenizers trained offline, saved as checkpoint directories.

* ``build_byte_level_bpe``: GPT-2 / Llama-3 style byte-level BPE (tokenizer.json),
  trained with the `tokenizers` trainer; optionally a BOS-adding post-processor.
* ``build_sentencepiece``: Llama-2 style SentencePiece BPE with byte fallback
  (tokenizer.model only), trained with ``SentencePieceTrainer``.
* ``build_byte_fallback_json``: that SentencePiece model converted by transformers
  to tokenizer.json (Replace/ByteFallback/Fuse/Strip decoder, as Llama-2 and
  Mistral ship it).

The vocabularies are small on purpose: rare characters (most CJK, emoji) come out
as several byte tokens, which is what the streaming detokenizer must get right.
"""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = [
    "Hello world, this is a small test corpus for a tiny tokenizer.",
    "The quick brown fox jumps over the lazy dog. 1234567890!",
    "Café, naïve, résumé, über, straße, señor, façade, crème brûlée.",
    "Ça va? Où est la gare? Ἀθῆναι. Добрый день, как дела?",
    "日本語のテキストです。東京は大きな都市です。",
    "中文文本测试，你好世界。我们今天学习分词器。",
    "한국어 텍스트입니다. 안녕하세요.",
    "emoji 😀🎉👍 rocket 🚀 family 👨‍👩‍👧 flag 🇯🇵 heart ❤️",
    "مرحبا بالعالم. नमस्ते दुनिया. שלום עולם.",
    "def add(a, b):\n    return a + b  # code\n\n\tindented\ttabs",
    "combining: e\u0301 a\u0308 n\u0303 — dashes – and “quotes”.",
]

BPE_SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|eot_id|>",
]

CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _write_json(file: Path, data: dict) -> None:
    file.write_text(json.dumps(data, ensure_ascii=False, indent=2), encoding="utf-8")


def build_byte_level_bpe(directory: Path, *, add_bos: bool = True) -> Path:
    """Byte-level BPE; ``add_bos`` puts ``<|begin_of_text|>`` in the post-processor (Llama-3 style)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        min_frequency=2,
        special_tokens=BPE_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    if add_bos:
        bos_id = tokenizer.token_to_id("<|begin_of_text|>")
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A",
            pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", bos_id)],
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    _write_json(
        directory / "tokenizer_config.json",
        {
            "bos_token": "<|begin_of_text|>",
            "eos_token": {"content": "<|end_of_text|>", "special": True, "__type": "AddedToken"},
            # transformers 5 ignores this when tokenizer.json exists; the post-processor decides.
            "add_bos_token": not add_bos,
            "chat_template": CHATML_TEMPLATE,
        },
    )
    im_end = tokenizer.token_to_id("<|im_end|>")
    eot = tokenizer.token_to_id("<|eot_id|>")
    _write_json(directory / "generation_config.json", {"eos_token_id": [im_end, eot]})
    _write_json(
        directory / "config.json",
        {"model_type": "llama", "eos_token_id": tokenizer.token_to_id("<|end_of_text|>")},
    )
    return directory


def build_sentencepiece(directory: Path) -> Path:
    """Llama-2 style SentencePiece: BPE, byte fallback, identity normalization, dummy prefix."""
    import sentencepiece

    directory.mkdir(parents=True, exist_ok=True)
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 20),
        model_prefix=str(directory / "tokenizer"),
        vocab_size=520,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=0.98,  # leave the rarest characters to the byte pieces
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
        num_threads=1,
    )
    (directory / "tokenizer.vocab").unlink()
    _write_json(
        directory / "tokenizer_config.json",
        {
            "add_bos_token": True,
            "add_eos_token": False,
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
        },
    )
    return directory


def build_byte_fallback_json(sentencepiece_dir: Path, directory: Path) -> Path:
    """The SentencePiece model as transformers converts it: tokenizer.json with a ByteFallback decoder."""
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(sentencepiece_dir)).save_pretrained(str(directory))
    return directory
