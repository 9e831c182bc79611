"""Would AWQ-style input-channel scaling help our rounding? (issue 48, item 4)

For every third block of a float model and its saved plan (``quantization-plan.json``, from
``mlxinfer convert -q``), each group of layers sharing one input (q/k/v; gate/up) is scaled per
input channel by ``s = a**(alpha/2)`` (``a``: the channel's mean x**2, normalised as AWQ does),
rounded at its planned bits and group with our importance-weighted least squares (weights
``a / s**2``: what the scaled input sees), and scored by the layer-output error AWQ's search
scores, with the full input covariance of the calibration pass: ``tr(dW H dW^T)``,
``H = X^T X / n``. Prints each group's error per alpha relative to alpha 0 (no scaling).

    python tools/awq_probe.py F32_DIR PLANNED_DIR

About five minutes for SmolLM2-135M on 2 cores.
"""

import json
import os
import sys

os.environ.setdefault("MLXINFER_CPU_PLANS", "off")

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

import mlxinfer  # noqa: E402,F401  (the BLAS first)
from mlxinfer.loading.loader import load_model  # noqa: E402
from mlxinfer.quant.calibrate import calibrate, calibration_sequences  # noqa: E402
from mlxinfer.quant.corpus import calibration_documents  # noqa: E402
from mlxinfer.quant.rounding import channel_weights, fit_affine  # noqa: E402
from mlxinfer.tokenization.tokenizer import Tokenizer  # noqa: E402

F32, PLANNED = sys.argv[1], sys.argv[2]
model, _ = load_model(F32)
tok = Tokenizer.from_dir(F32)
docs = calibration_documents(tok)
seqs = calibration_sequences([tok.encode(d) for d in docs], ctx=512, max_tokens=8192, bos=None)
stats = calibrate(model, seqs, covariance=True)
H = stats.covariances
print("covariances for", len(H), "inputs; keys like", list(H)[:2])
W = mx.load(os.path.join(F32, "model.safetensors"))
plan = json.load(open(os.path.join(PLANNED, "quantization-plan.json")))["settings"]
alphas = [0.0, 0.1, 0.25, 0.5]
tot = np.zeros(len(alphas))
picked = []


def key_for(path):
    for k in H:
        if k == path or k.startswith(path) or path in k.split("|"):
            return k
    return None


for L in range(0, 30, 3):
    for group in (
        ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
        ["mlp.gate_proj", "mlp.up_proj"],
    ):
        paths = [f"model.layers.{L}.{g}" for g in group]
        k = key_for(paths[0])
        h = mx.array(np.asarray(H[k], np.float32))
        a = mx.diag(h)
        a = a / a.mean()
        hn = h / mx.diag(h).mean()
        errs = []
        for al in alphas:
            s = mx.power(mx.maximum(a, 1e-8), al / 2)
            s = s / mx.sqrt(s.max() * s.min())
            e = 0.0
            for p in paths:
                bits, gs = map(int, plan[p].split(":"))
                w = W[p + ".weight"].astype(mx.float32)
                wp = w * s
                wq, sc, bi = fit_affine(
                    wp, group_size=gs, bits=bits, weights=channel_weights(a / (s * s), wp.shape)
                )
                dw = w - mx.dequantize(wq, sc, bi, group_size=gs, bits=bits) / s
                e += ((dw @ hn) * dw).sum().item()
            errs.append(e)
        tot += np.array(errs)
        picked.append(alphas[int(np.argmin(errs))])
        print(L, group[0], [f"{x / errs[0]:.3f}" for x in errs], flush=True)
print("total ratio by alpha", tot / tot[0], "picked", picked)
