"""The ``bert`` family (mlxinfer/models/bert.py) against transformers' ``BertModel``: a tiny
random BERT saved by ``save_pretrained`` (every parameter perturbed, LayerNorms and biases
included), its hidden states within 1e-4 of transformers' on rows of several lengths, and a
right-padded batch giving each row the states it has alone. ``write_bert`` also serves
tests/embeddings/test_bert_embeddings.py."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers
from hf_models import CORPUS

from mlxinfer.errors import ConfigError
from mlxinfer.loading.loader import load_model

BERT = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    max_position_embeddings=64,
    type_vocab_size=2,
)
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def add_wordpiece_tokenizer(
    path: Path, vocab_size: int = 200
) -> transformers.PreTrainedTokenizerFast:
    """BERT's kind of tokenizer, trained on a small corpus: lower-casing, WordPiece, and a
    post-processor writing ``[CLS] text [SEP]``. Saved as tokenizer.json; returned as
    transformers' tokenizer of the same file (the reference's)."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    tok.save(str(path / "tokenizer.json"))
    names = dict(zip(("pad_token", "unk_token", "cls_token", "sep_token", "mask_token"), SPECIALS))
    config = {"tokenizer_class": "BertTokenizer", "do_lower_case": True, **names}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(path / "tokenizer.json"), **names
    )


def write_bert(path: Path, *, masked_lm: bool = False, seed: int = 0):
    """(directory, transformers' tokenizer, transformers' BertModel) of a tiny random BERT;
    ``masked_lm``: saved from ``BertForMaskedLM`` (weights under ``bert.``, an MLM head)."""
    path.mkdir(parents=True)
    tokenizer = add_wordpiece_tokenizer(path)
    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=len(tokenizer), **BERT)
    kind = transformers.BertForMaskedLM if masked_lm else transformers.BertModel
    model = kind(config).eval()
    with torch.no_grad():  # random init leaves LayerNorms at 1 and 0, biases at 0: perturb all
        for p in model.parameters():
            p.add_(torch.randn_like(p) * (0.08 if p.dim() > 1 else 0.1))
    model.save_pretrained(path)
    return path, tokenizer, model.bert if masked_lm else model


def torch_states(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).last_hidden_state[0].numpy()


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return write_bert(tmp_path_factory.mktemp("bert") / "tiny-bert")


@pytest.fixture(scope="module")
def ours(bert):
    return load_model(bert[0])[0]


def test_hidden_states_match_transformers(bert, ours):
    _, tokenizer, model = bert
    for text in CORPUS[:4]:
        ids = tokenizer(text)["input_ids"]
        assert ids[0] == tokenizer.cls_token_id and ids[-1] == tokenizer.sep_token_id
        got = np.array(ours.encode(mx.array([ids])))[0]
        np.testing.assert_allclose(got, torch_states(model, ids), atol=1e-4)


def test_a_padded_batch_gives_each_row_its_own_states(bert, ours):
    """Rows of 3, 9 and 17 tokens right-padded with a real token id (not [PAD]): with their
    lengths, each row's real tokens have its states alone; without, the pads leak in (the
    check would catch a mask that does nothing)."""
    _, _, model = bert
    rows = [[2, 40, 3], [2, *range(50, 57), 3], [2, *range(60, 75), 3]]
    width = max(len(r) for r in rows)
    ids = mx.array([r + [7] * (width - len(r)) for r in rows])
    masked = np.array(ours.encode(ids, mx.array([len(r) for r in rows])))
    unmasked = np.array(ours.encode(ids))
    for i, row in enumerate(rows):
        alone = torch_states(model, row)
        np.testing.assert_allclose(masked[i, : len(row)], alone, atol=1e-4)
        if len(row) < width:
            assert np.abs(unmasked[i, : len(row)] - alone).max() > 1e-2


def test_a_masked_lm_checkpoint_loads_its_encoder(tmp_path):
    """BertForMaskedLM's weights (``bert.`` prefix, ``cls.predictions`` head) load as the
    encoder: the same states as its ``.bert``."""
    path, tokenizer, model = write_bert(tmp_path / "mlm", masked_lm=True, seed=1)
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", "np") as f:
        keys = set(f.keys())
    assert "bert.embeddings.word_embeddings.weight" in keys
    assert any(k.startswith("cls.predictions") for k in keys)
    ids = tokenizer(CORPUS[1])["input_ids"]
    got = np.array(load_model(path)[0].encode(mx.array([ids])))[0]
    np.testing.assert_allclose(got, torch_states(model, ids), atol=1e-4)


def test_generating_with_an_encoder_is_one_line(bert, ours):
    from mlxinfer import generate, load

    model, tokenizer = load(str(bert[0]))
    for call in (lambda: generate(model, tokenizer, "hello", max_tokens=2), ours.make_cache):
        with pytest.raises(ConfigError) as e:
            call()
        assert "'bert' is an encoder" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"position_embedding_type": "relative_key"}, "position_embedding_type"),
        ({"type_vocab_size": 0}, "type_vocab_size"),
        ({"hidden_act": "swish_beta"}, "unsupported activation"),
        ({"hidden_size": 66}, "multiple of 'num_attention_heads'"),
    ],
)
def test_configs_bert_cannot_run_are_config_errors(bert, tmp_path, change, message):
    import shutil

    path = tmp_path / "bad"
    shutil.copytree(bert[0], path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ConfigError, match=message) as e:
        load_model(path)
    assert "config.json" in str(e.value) and "\n" not in str(e.value)
