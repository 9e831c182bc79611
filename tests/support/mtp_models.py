"""Tiny random MiMo checkpoints (a Qwen2 trunk plus MTP heads) and transformers' reference head.

transformers has no MiMo model and ``save_pretrained`` never writes MTP weights, so: build a
Qwen2 model with one more layer per head, save the first L layers as the trunk, write each extra
layer as a head's block under MiMo's names (``model.mtp_layers.i.*``) with random head norms and
projection, and load the same tensors into transformers' ``MtpModel`` (``MtpLayer`` with
``mtp_hidden_states_first``: MiMo's [h, e] order) over the trunk. No real MTP weights can be
had here; these are the references.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from hf_models import TINY
from safetensors.torch import load_file, save_file

# Our name in a MiMo head -> transformers' MtpLayer name (the block's own names go under mtp_block).
HEAD_NAMES = {
    "token_layernorm": "enorm",
    "hidden_layernorm": "hnorm",
    "input_proj": "eh_proj",
    "final_layernorm": "post_norm",
}


def make_mimo(
    path: Path, *, seed: int = 0, heads: int = 1, wired: float | None = None, **overrides
) -> tuple[Path, torch.nn.Module, torch.nn.Module]:
    """Save a random MiMo checkpoint to ``path``; returns (path, trunk, reference MtpModel).

    ``wired``: a one-layer trunk whose head predicts the trunk's own next-next token, up to
    noise of this size on its projection. The trunk's attention is cut (o_proj = 0), so its
    output at position j depends on x_j alone, and its embeddings have RMS 1; the head's block
    is the trunk's block, its projection picks the embedding of x_{j+1} (``[0 | I]`` on
    MiMo's [h, e]), its token norm is 1 and its output norm the trunk's final norm, so the head
    computes at (h_j, x_{j+1}) exactly the trunk's state at j+1: its greedy token is the one
    the trunk emits after x_{j+1}. Any mistake in the pairing, the concat order or the cache
    priming loses that.
    """
    from transformers.modeling_layers import MtpModel

    torch.manual_seed(seed)
    settings = {**TINY, **overrides}
    L = settings["num_hidden_layers"]
    big_config = transformers.AutoConfig.for_model(
        "qwen2", **{**settings, "num_hidden_layers": L + heads}
    )
    big = transformers.AutoModelForCausalLM.from_config(
        big_config, torch_dtype=torch.float32
    ).eval()
    with torch.no_grad():
        for p in big.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
            else:
                p.add_(torch.randn_like(p) * 0.1)  # norms and biases exercised too
        if wired is not None:
            assert L == 1 and heads == 1, "a wired head copies the one trunk block"
            E = big.model.embed_tokens.weight
            E /= E.pow(2).mean(-1, keepdim=True).sqrt()
            for layer in big.model.layers:
                layer.self_attn.o_proj.weight.zero_()
            big.model.layers[1].load_state_dict(big.model.layers[0].state_dict())
    config = transformers.AutoConfig.for_model("qwen2", **settings)
    trunk = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
    state = big.state_dict()
    trunk.load_state_dict({k: v for k, v in state.items() if k in trunk.state_dict()})
    trunk.save_pretrained(path, safe_serialization=True)

    H = settings["hidden_size"]
    weights = load_file(str(Path(path) / "model.safetensors"))
    reference: dict[str, torch.Tensor] = {}
    for i in range(heads):
        block = f"model.layers.{L + i}."
        for k, v in state.items():
            if k.startswith(block):
                name = k[len(block) :]
                weights[f"model.mtp_layers.{i}.{name}"] = v.clone()
                reference[f"layers.{i}.mtp_block.{name}"] = v
        for ours, theirs in HEAD_NAMES.items():
            if ours == "input_proj":
                v = torch.randn(H, 2 * H) * 0.08
                if wired is not None:
                    v = torch.cat([torch.zeros(H, H), torch.eye(H)], dim=1) + wired * v
            elif wired is not None and ours == "token_layernorm":
                v = torch.ones(H)
            elif wired is not None and ours == "final_layernorm":
                v = state["model.norm.weight"].clone()
            else:
                v = 1 + 0.1 * torch.randn(H)
            weights[f"model.mtp_layers.{i}.{ours}.weight"] = v
            reference[f"layers.{i}.{theirs}.weight"] = v
    save_file(weights, str(Path(path) / "model.safetensors"), metadata={"format": "pt"})
    cfg_path = Path(path) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(model_type="mimo", architectures=["MiMoForCausalLM"], num_nextn_predict_layers=heads)
    cfg_path.write_text(json.dumps(cfg, indent=2))

    trunk.config.num_mtp_layers = heads
    trunk.config.mtp_layer_types = ["full_attention"] * heads
    trunk.config.mtp_hidden_states_first = True
    mtp = MtpModel(trunk, heads).eval()
    missing, unexpected = mtp.load_state_dict(reference, strict=False)
    assert not unexpected and all(k.startswith(("embed_tokens", "shared_head")) for k in missing)
    return Path(path), trunk, mtp


def strip_heads(path: Path) -> Path:
    """The checkpoint at ``path`` with its MTP weights removed (config.json still announces them)."""
    file = Path(path) / "model.safetensors"
    weights = load_file(str(file))
    save_file(
        {k: v for k, v in weights.items() if ".mtp_layers." not in k},
        str(file),
        metadata={"format": "pt"},
    )
    return Path(path)


def transformers_layout(trunk: torch.nn.Module, mtp: torch.nn.Module, out: Path) -> Path:
    """The same model as transformers' ``generate(use_mtp=True)`` loads it: DeepSeek's layout
    (the head as decoder layer L: ``model.layers.L.{enorm, hnorm, eh_proj, shared_head.norm}``
    and its block's own names) with ``num_mtp_layers`` and ``mtp_hidden_states_first`` in
    config.json. ``MtpModel.from_pretrained`` finds the head's weights through the trunk class's
    ``_keys_to_ignore_on_load_unexpected``: the caller patches it to match ``model.layers.L.``."""
    L = trunk.config.num_hidden_layers
    trunk.save_pretrained(out, safe_serialization=True)
    weights = load_file(str(Path(out) / "model.safetensors"))
    for k, v in mtp.state_dict().items():
        if k.startswith("layers.0."):
            name = k[len("layers.0.") :].replace("mtp_block.", "")
            name = name.replace("post_norm", "shared_head.norm")
            weights[f"model.layers.{L}.{name}"] = v.clone()
    save_file(weights, str(Path(out) / "model.safetensors"), metadata={"format": "pt"})
    cfg_path = Path(out) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(num_mtp_layers=1, mtp_layer_types=["full_attention"], mtp_hidden_states_first=True)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return Path(out)


MLA = dict(
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=24,
    num_key_value_heads=4,
    moe_intermediate_size=32,
    n_routed_experts=8,
)
DEEPSEEK_V3 = dict(
    model_type="deepseek_v3",
    **MLA,
    q_lora_rank=48,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    n_group=4,
    topk_group=2,
)
# GLM-4.7-Flash: DeepSeek-V3's MLA and router under GLM's name (its config.json names
# first_k_dense_replace as DeepSeek's do; transformers reads mlp_layer_types, dense first)
GLM_LITE = dict(
    model_type="glm4_moe_lite",
    **{**MLA, "num_key_value_heads": 4},
    q_lora_rank=48,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    routed_scaling_factor=1.8,
    norm_topk_prob=True,
)
GLM = dict(
    model_type="glm4_moe",
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
    attention_bias=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)


def make_nextn(path: Path, spec: dict, *, seed: int = 0):
    """A tiny GLM-4.5 (``GLM``) or DeepSeek-V3 (``DEEPSEEK_V3``) checkpoint laid out as the real ones: the MTP layer as decoder layer L
    (an MoE block) plus ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and the copies
    of the embedding and head DeepSeek-V3 ships. Returns (path, trunk, MtpModel), both loaded
    by transformers from the file (``MtpModel.from_pretrained``, the trunk's MTP pattern pointed
    at layer L)."""
    from transformers.modeling_layers import MtpModel

    torch.manual_seed(seed)
    settings = {**TINY, **spec}
    L = settings["num_hidden_layers"]
    config = transformers.AutoConfig.for_model(**{**settings, "num_hidden_layers": L + 1})
    big = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in big.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
            else:
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in big.named_buffers():
            if "e_score_correction_bias" in name:
                b.add_(torch.randn_like(b) * 0.1)
    big.save_pretrained(path, safe_serialization=True)
    file = Path(path) / "model.safetensors"
    weights = load_file(str(file))
    H = settings["hidden_size"]
    head = f"model.layers.{L}."
    for name in ("enorm", "hnorm", "shared_head.norm"):
        weights[f"{head}{name}.weight"] = 1 + 0.1 * torch.randn(H)
    weights[f"{head}eh_proj.weight"] = torch.randn(H, 2 * H) * 0.08
    weights[f"{head}embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
    weights[f"{head}shared_head.head.weight"] = weights["lm_head.weight"].clone()
    save_file(weights, str(file), metadata={"format": "pt"})
    cfg_path = Path(path) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(num_hidden_layers=L, num_nextn_predict_layers=1)
    cfg_path.write_text(json.dumps(cfg, indent=2))

    trunk = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # transformers finds the MTP weights by this pattern (46 and 92 for the real GLM-4.5s).
    trunk._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{L}\."]
    if settings["model_type"] == "glm4_moe_lite":  # no MTP config in transformers: say it
        trunk.config.num_mtp_layers = 1
        trunk.config.mtp_mlp_layer_types = ["sparse"]
    mtp = MtpModel.from_pretrained(trunk).eval()
    return Path(path), trunk, mtp


def strip_layer_heads(path: Path, layer: int) -> Path:
    """The checkpoint at ``path`` without decoder layer ``layer`` (its MTP layer)."""
    file = Path(path) / "model.safetensors"
    weights = load_file(str(file))
    prefix = f"model.layers.{layer}."
    save_file(
        {k: v for k, v in weights.items() if not k.startswith(prefix)},
        str(file),
        metadata={"format": "pt"},
    )
    return Path(path)


QWEN3_NEXT = dict(
    model_type="qwen3_next",
    head_dim=16,
    num_hidden_layers=4,
    # transformers' MtpModel takes its norm class from the trunk's last layer: end on attention.
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=64,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    eos_token_id=None,
)


def make_qwen_mtp(path: Path, spec: dict = QWEN3_NEXT, *, seed: int = 0):
    """A tiny Qwen3-Next (or Qwen3.5) checkpoint with Qwen's MTP layout: ``mtp.layers.0.*`` (a
    full-attention block) and ``mtp.{fc, pre_fc_norm_embedding, pre_fc_norm_hidden, norm}``
    ((1 + w) norms). transformers has no MTP config for these; its ``MtpModel.from_pretrained``
    loads the layout once the trunk's config says ``num_mtp_layers = 1`` and
    ``mtp_layer_types = ["full_attention"]`` (its conversion maps fc / pre_fc_norm_* / norm onto
    eh_proj / enorm / hnorm / post_norm). Returns (path, trunk, MtpModel)."""
    from transformers.modeling_layers import MtpModel

    torch.manual_seed(seed)
    settings = {**TINY, **spec}
    L = settings["num_hidden_layers"]
    kinds = settings["layer_types"]
    config = transformers.AutoConfig.for_model(
        **{**settings, "num_hidden_layers": L + 1, "layer_types": kinds + ["full_attention"]}
    )
    big = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in big.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    big.save_pretrained(path, safe_serialization=True)
    file = Path(path) / "model.safetensors"
    weights = load_file(str(file))
    block = f"model.layers.{L}."
    weights = {
        (f"mtp.layers.0.{k[len(block) :]}" if k.startswith(block) else k): v
        for k, v in weights.items()
    }
    H = settings["hidden_size"]
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        weights[f"mtp.{name}.weight"] = 0.1 * torch.randn(H)  # (1 + w): w near 0
    weights["mtp.fc.weight"] = torch.randn(H, 2 * H) * 0.08
    save_file(weights, str(file), metadata={"format": "pt"})
    cfg_path = Path(path) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(num_hidden_layers=L, layer_types=kinds, mtp_num_hidden_layers=1)
    cfg_path.write_text(json.dumps(cfg, indent=2))

    trunk = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    trunk.config.num_mtp_layers = 1
    trunk.config.mtp_layer_types = ["full_attention"]
    mtp = MtpModel.from_pretrained(trunk).eval()
    return Path(path), trunk, mtp
