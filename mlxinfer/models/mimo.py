"""The MiMo family (Xiaomi MiMo-7B: ``model_type: mimo``): a Qwen2 trunk plus MTP heads.

The trunk is Qwen2's (q/k/v biases, optional sliding window). ``num_nextn_predict_layers``
heads follow it, each a Qwen2 block plus the head's own norms and projection, written as
``model.mtp_layers.i.{token_layernorm, hidden_layernorm, input_proj, final_layernorm}`` beside
the block's ``input_layernorm``, ``self_attn``, ``post_attention_layernorm`` and ``mlp``. The
head concatenates the hidden state first ([h, e], DeepSeek's order reversed); see
``layers/mtp.py`` for what a head computes and ``generation/mtp_drafts.py`` (``MTP``) for drafting.

transformers has no MiMo model: the trunk is checked against its Qwen2, the head against its
``MtpLayer`` with ``mtp_hidden_states_first`` over a Qwen2 block (tests/models/test_mimo.py).
"""

from __future__ import annotations

import dataclasses

from . import qwen2
from .layers.mtp import MIMO, MTPHeads, extend_block


@dataclasses.dataclass
class ModelArgs(qwen2.ModelArgs):
    num_nextn_predict_layers: int = 0

    def __post_init__(self):
        super().__post_init__()
        self.qkv_bias, self.o_bias = True, False  # Qwen2's attention, which MiMo's code uses


class MiMoModel(qwen2.Qwen2Model):
    """Qwen2's embedding → blocks → norm, plus the MTP heads' blocks (``mtp_layers``), which
    the trunk's forward never runs."""

    def __init__(self, args: qwen2.ModelArgs):
        assert isinstance(args, ModelArgs)  # the family's own (Model.Inner's signature is Qwen2's)
        super().__init__(args)
        self.mtp_layers = [
            extend_block(self.Block(args, 0), MIMO, args.hidden_size, args.rms_norm_eps)
            for _ in range(args.num_nextn_predict_layers)
        ]


class Model(MTPHeads, qwen2.Model):
    Inner = MiMoModel
    mtp_spec = MIMO
