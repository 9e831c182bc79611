"""Qwen3-VL: the qwen3 network (q/k norms) with interleaved multimodal RoPE and deepstack, and
Qwen3-VL's ViT (learned, resampled position table; no windows).

Everything but the tower and two settings is Qwen2.5-VL's (qwen2_5_vl.py: the flow of images
into the prompt, the request's positions and delta):

- ``mrope_interleaved``: the frequencies go t, h, w, t, h, w ... (layers/mrope.py);
- deepstack: the tower's states after each block of ``deepstack_visual_indexes``, merged by
  their own mergers, are added to the image positions of the outputs of the language model's
  first ``len(deepstack_visual_indexes)`` layers (``image_inputs`` gives them as ``deepstack``
  (n, 1, L, hidden), zero at text positions, so a prefill chunk takes its own slice).
"""

from __future__ import annotations

from .qwen2_5_vl import Model as Qwen25VLModel
from .qwen2_5_vl import ModelArgs
from .towers.qwen_vit import Qwen3VisionModel

__all__ = ["Model", "ModelArgs"]


class Model(Qwen25VLModel):
    Tower = Qwen3VisionModel
