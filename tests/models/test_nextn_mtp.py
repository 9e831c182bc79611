"""GLM-4.5, DeepSeek-V3, Qwen3-Next and Qwen3.5 keep their MTP layers: against transformers'
own MTP path (``MtpModel.from_pretrained`` over a tiny random checkpoint in the real layout:
decoder layer L for GLM and DeepSeek, ``mtp.*`` for Qwen; ``generate(use_mtp=True)`` where the
trunk is not hybrid). DeepSeek's head is MLA + MoE on a latent cache; Qwen's a gated attention
block with (1 + w) norms over a hybrid (Gated DeltaNet) trunk. No real MTP weights can be had
here."""

import shutil

import mlx.core as mx
import numpy as np
import pytest
import torch
from hf_models import torch_greedy
from mtp_models import (
    DEEPSEEK_V3,
    GLM,
    GLM_LITE,
    QWEN3_NEXT,
    make_nextn,
    make_qwen_mtp,
    strip_layer_heads,
)
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers.cache_utils import MtpCache

from mlxinfer.generation import generate_step
from mlxinfer.generation.mtp_drafts import MTP
from mlxinfer.generation.speculative import speculative_generate_step
from mlxinfer.loading.convert import convert
from mlxinfer.loading.loader import load_model

IDS = [5, 17, 33, 2, 99, 120, 7, 64, 3, 11, 42, 8]


QWEN3_5_DENSE = dict(
    {k: v for k, v in QWEN3_NEXT.items() if "expert" not in k},
    model_type="qwen3_5_text",
)
QWEN = {"qwen3_next": QWEN3_NEXT, "qwen3_5_text": QWEN3_5_DENSE}
PROJ = {"glm4_moe": "eh_proj", "deepseek_v3": "eh_proj", "glm4_moe_lite": "eh_proj",
        "qwen3_next": "fc", "qwen3_5_text": "fc"}  # fmt: skip
NEXTN = {"glm4_moe": GLM, "deepseek_v3": DEEPSEEK_V3, "glm4_moe_lite": GLM_LITE}


@pytest.fixture(scope="module", params=sorted(PROJ))
def glm(request, tmp_path_factory):
    where = tmp_path_factory.mktemp(request.param) / "m"
    if request.param in QWEN:
        path, trunk, mtp = make_qwen_mtp(where, QWEN[request.param])
    else:
        path, trunk, mtp = make_nextn(where, NEXTN[request.param])
    return path, trunk, mtp, load_model(path)[0]


def strip_heads(path, config: dict):
    """The checkpoint without its MTP weights (config.json still announces them)."""
    if config.get("mtp_num_hidden_layers"):
        file = path / "model.safetensors"
        weights = load_file(str(file))
        save_file({k: v for k, v in weights.items() if not k.startswith("mtp.")}, str(file))
        return path
    return strip_layer_heads(path, layer=config["num_hidden_layers"])


def test_head_logits_match_transformers_with_cache_and_chained(glm):
    _, trunk, mtp, model = glm
    T = len(IDS)
    with torch.no_grad():
        h = trunk(torch.tensor([IDS]), output_hidden_states=True).hidden_states[-1]
        cache = MtpCache(config=trunk.config.get_mtp_config())
        g = mtp.forward_layer(
            0, h[:, :-1], torch.arange(1, T)[None], cache, input_ids=torch.tensor([IDS[1:]])
        )
        ref = [mtp._project_to_logits(g)[0].numpy()]
        for i in range(2):  # chained on its own output and greedy token
            token = int(ref[-1][-1].argmax())
            g = mtp.forward_layer(
                0, g[:, -1:], torch.tensor([[T + i]]), cache, input_ids=torch.tensor([[token]])
            )
            ref.append(mtp._project_to_logits(g)[0].numpy())
    hidden, logits = model.trunk(mx.array([IDS]))
    np.testing.assert_allclose(np.array(logits[0]), torch_logits(trunk), atol=1e-3)
    head = model.mtp_heads[0]
    c = head.make_cache()
    rows = []
    for j in range(T - 1):
        g = head(mx.array([[IDS[j + 1]]]), hidden[:, j : j + 1], c)
        rows.append(np.array(head.logits(g)[0, 0]))
    for _ in range(2):
        g = head(mx.array([[int(np.argmax(rows[-1]))]]), g, c)
        rows.append(np.array(head.logits(g)[0, 0]))
    np.testing.assert_allclose(np.stack(rows), np.concatenate(ref), atol=1e-3)


def torch_logits(trunk):
    with torch.no_grad():
        return trunk(torch.tensor([IDS])).logits[0].numpy()


@pytest.mark.parametrize("num_draft", [None, 1, 3])
def test_greedy_with_mtp_equals_plain_and_transformers(glm, num_draft):
    _, trunk, _, model = glm
    plain = [t for t, _ in generate_step(IDS, model, max_tokens=16)]
    steps = list(speculative_generate_step(IDS, model, MTP(), max_tokens=16, num_draft=num_draft))
    assert [s[0] for s in steps] == plain == torch_greedy(trunk, IDS, 16)
    assert sum(s[4] for s in steps) > 0
    if num_draft == 1 and trunk.config.model_type not in QWEN:  # hybrids: see the issue
        with torch.no_grad():
            trunk.generation_config.eos_token_id = None  # a random model may well emit it
            theirs = trunk.generate(
                torch.tensor([IDS]), max_new_tokens=16, do_sample=False, use_mtp=True
            )[0, len(IDS) :].tolist()
        assert theirs == plain


def test_stripped_mtp_layer_loads_without_heads(glm, tmp_path):
    import json

    config = json.loads((glm[0] / "config.json").read_text())
    path = strip_heads(shutil.copytree(glm[0], tmp_path / "stripped"), config)
    model = load_model(path)[0]  # config.json still announces one MTP layer
    assert model.mtp_heads == []
    assert [t for t, _ in generate_step(IDS, model, max_tokens=6)] == [
        t for t, _ in generate_step(IDS, glm[3], max_tokens=6)
    ]


def test_4bit_convert_keeps_the_head_with_router_and_norms_float(glm, tmp_path):
    from hf_models import add_tokenizer

    src = add_tokenizer(shutil.copytree(glm[0], tmp_path / "src"), vocab_size=256)
    out = tmp_path / "q4"
    convert(src, out, quantize=True, bits=4, group_size=32)
    with safe_open(str(out / "model.safetensors"), "np") as f:
        keys = set(f.keys())
    head, spec = "model.mtp_layers.0.", glm[3].mtp_spec
    assert f"{head}{spec.proj}.scales" in keys  # quantized like the trunk
    assert f"{head}mlp.down_proj.scales" in keys or f"{head}mlp.experts.down_proj.scales" in keys
    assert f"{head}mlp.gate.scales" not in keys  # a router stays float
    for norm in (spec.enorm, spec.hnorm, spec.post_norm):
        assert f"{head}{norm}.weight" in keys and f"{head}{norm}.scales" not in keys
    assert not any(k.startswith(f"{head}embed_tokens") for k in keys)  # the trunk's serve
    model = load_model(out)[0]
    plain = [t for t, _ in generate_step(IDS, model, max_tokens=10)]
    drafted = [s[0] for s in speculative_generate_step(IDS, model, MTP(), max_tokens=10)]
    assert drafted == plain
