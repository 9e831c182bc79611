"""Build the transformers reference checkpoint for SmolLM2-135M-Instruct.

transformers can read the GGUF itself: it dequantizes every tensor to float32
and undoes llama.cpp's Q/K row permutation. Saving that model gives a plain HF
float32 checkpoint that parity tests compare mlxinfer against.

    python tools/make_reference.py SmolLM2-135M-Instruct.Q4_1.gguf out_dir/

Tests import :func:`build_smollm2_reference` through ``tests/fixtures.py``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import uuid
from pathlib import Path


def build_smollm2_reference(out_dir: Path, gguf_path: Path) -> Path:
    """Write a float32 HF checkpoint + tokenizer converted by transformers from ``gguf_path``.

    ``out_dir`` must not exist; it appears complete or not at all.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir, gguf_path = Path(out_dir), Path(gguf_path)
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    dtype_kw = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"  # renamed in 4.56
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, **{dtype_kw: torch.float32}
    )
    # The loaded model remembers it came from a quantized file; forget that so it saves
    # as an ordinary float32 checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", type=Path, help="SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("out_dir", type=Path, help="directory to create")
    args = parser.parse_args(argv)
    print(build_smollm2_reference(args.out_dir, args.gguf))


if __name__ == "__main__":
    main()
