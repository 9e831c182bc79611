"""Write tiny GGUFs made by llama.cpp's own converter, and transformers' answers for them.

    python tools/make_gguf_fixtures.py --llama-cpp DIR [--arch ARCH ...]

ARCH: qwen35, qwen35moe, qwen3next (Qwen3.5/3.6 and Qwen3-Next), glm4moelite (GLM-4.7-Flash,
llama.cpp's ``deepseek2`` architecture with its MTP layer), deepseek3 and deepseek2lite
(DeepSeek-V3 and a V2-Lite-like model: ``deepseek2`` files without MTP, which llama.cpp's
converter drops for them), llama31 (Llama with Llama 3.1's RoPE scaling, written as the
``rope_freqs`` tensor), qwen2 (Qwen2.5), gemma2 (Gemma 2), phi4mini (Phi-4-mini: ``phi3``
with LongRoPE as tensors), smollm3 (SmolLM3), olmo2 and olmo3 (OLMo 2/3: ``olmo2``), ministral3 (``mistral3``: YaRN and
Llama 4's query scaling), lfm2 (LFM2: short convolutions), granite (Granite 3.x: four multipliers); default: all. DIR is a llama.cpp source tree (its ``conversion/``
package and ``gguf-py/``; the llama-cpp-python sdist carries one under ``vendor/llama.cpp``:
``pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all:``). Needs the test extras
(transformers, torch==2.13.0).

A random model of each kind (tests/support/mtp_models.py: one MTP layer where the family has
one; Qwen3.5's linear attention with two value heads per key head, so llama.cpp's reordering
of value heads is exercised) is saved by transformers, its matrices rounded to float16 values,
and converted by llama.cpp's converter class for it in float16, as
``convert_hf_to_gguf.py --outtype f16`` runs it (so the file holds exactly what transformers
runs); only the vocabulary step is replaced (the tiny models have no tokenizer): it writes the
byte-level BPE vocabulary the other GGUF tests use. Written to ``tests/fixtures/gguf/``:

- ``<arch>.gguf``: the file (a few hundred KB);
- ``<arch>.reference.safetensors``: transformers' trunk logits over ``IDS``, its greedy
  continuation, without an MTP layer the last 8 rows of the logits over an 80-token prompt, and
  (with an MTP layer) the MTP head's logits at every prompt position then
  chained twice on its own output (``MtpModel.forward_layer``, as
  tests/models/test_nextn_mtp.py computes them); its metadata names the transformers, torch
  and llama.cpp versions.

tests/gguf/test_gguf_converted.py imports each file and compares with these numbers.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "gguf"
IDS = [5, 17, 33, 2, 99, 120, 7, 64, 3, 11, 42, 8]
GREEDY = 16
LONG = 80  # a prompt past the tiny RoPE-scaled configs' 64 original positions


ARCHS = ("qwen35", "qwen35moe", "qwen3next", "glm4moelite", "deepseek3", "deepseek2lite", "llama31",
         "qwen2", "gemma2", "phi4mini", "smollm3", "olmo2", "olmo3", "ministral3", "lfm2",
         "granite")  # fmt: skip
NO_MTP = ("deepseek3", "deepseek2lite", "llama31", "qwen2", "gemma2", "phi4mini", "smollm3",
          "olmo2", "olmo3", "ministral3", "lfm2", "granite")  # fmt: skip


def spec(arch: str, vocab: int) -> dict:
    from mtp_models import DEEPSEEK_V3, GLM_LITE, QWEN3_NEXT
    from mtp_models import MLA as _MLA

    # qk_nope of 32: attn_k_b's rows (it is stored transposed) split into Q8_0 blocks
    MLA = {**_MLA, "qk_nope_head_dim": 32}
    GLM_LITE = {**GLM_LITE, "qk_nope_head_dim": 32}
    DEEPSEEK_V3 = {**DEEPSEEK_V3, "qk_nope_head_dim": 32}

    # scoring_func and topk_method: what the real configs say and llama.cpp's converter reads
    # (transformers keeps them as plain attributes)
    if arch == "glm4moelite":
        return {
            **GLM_LITE,
            "vocab_size": vocab,
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
        }
    if arch == "deepseek3":  # with YaRN as DeepSeek-V3 has it (mscale = mscale_all_dim)
        yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707,
                "original_max_position_embeddings": 64}  # fmt: skip
        return {**DEEPSEEK_V3, "vocab_size": vocab, "scoring_func": "sigmoid",
                "topk_method": "noaux_tc", "rope_parameters": yarn}  # fmt: skip
    if arch == "llama31":  # Llama 3.1's RoPE scaling, which the converter writes as rope_freqs
        llama3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}  # fmt: skip
        return {"model_type": "llama", "vocab_size": vocab, "rope_parameters": llama3}
    if arch == "phi4mini":  # Phi-4-mini: LongRoPE over 3/4 of each head, tied, no window
        half = 6  # rotated pairs: 16 * 0.75 / 2
        longrope = {"rope_type": "longrope", "rope_theta": 10000.0,
                    "long_factor": [1.0 + 0.7 * i for i in range(half)],
                    "short_factor": [1.0 + 0.05 * i for i in range(half)],
                    "original_max_position_embeddings": 64}  # fmt: skip
        return {"model_type": "phi3", "vocab_size": vocab, "tie_word_embeddings": True,
                "partial_rotary_factor": 0.75, "rope_parameters": longrope,
                "original_max_position_embeddings": 64, "sliding_window": None,
                "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
    if arch == "ministral3":  # YaRN and Llama 4's query scaling past 64 original positions
        yarn = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "beta_fast": 32.0,
                "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 64, "llama_4_scaling_beta": 0.1}  # fmt: skip
        return {"model_type": "ministral3", "vocab_size": vocab, "rope_parameters": yarn,
                "head_dim": 16, "pad_token_id": 0, "bos_token_id": 1,
                "eos_token_id": 2}  # fmt: skip
    if arch == "granite":  # the four multipliers far from 1, so that each one counts
        return {"model_type": "granite", "vocab_size": vocab, "embedding_multiplier": 3.0,
                "residual_multiplier": 0.5, "attention_multiplier": 0.3, "logits_scaling": 2.0,
                "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
    if arch == "lfm2":  # convolution layers around attention ones; the SwiGLU width adjusted
        return {"model_type": "lfm2", "vocab_size": vocab, "num_hidden_layers": 4,
                "layer_types": ["conv", "full_attention", "conv", "full_attention"],
                "block_ff_dim": 192, "intermediate_size": 192, "block_multiple_of": 32,
                "block_auto_adjust_ff_dim": True, "pad_token_id": 0, "bos_token_id": 1,
                "eos_token_id": 2}  # fmt: skip
    if arch == "smollm3":  # 4 layers: the 4th has no RoPE
        return {"model_type": "smollm3", "vocab_size": vocab, "num_hidden_layers": 4,
                "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
    if arch in ("olmo2", "olmo3"):  # OLMo 3: a window shorter than the prompt, every 4th full
        window = {"sliding_window": 8} if arch == "olmo3" else {}
        return {"model_type": arch, "vocab_size": vocab, "num_hidden_layers": 4, **window,
                "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
    if arch == "qwen2":  # Qwen2.5: q/k/v biases, tied embeddings as the small ones have them
        return {"model_type": "qwen2", "vocab_size": vocab, "tie_word_embeddings": True,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}  # fmt: skip
    if arch == "gemma2":  # soft-capped logits, a window shorter than the prompt, 4 layers
        return {"model_type": "gemma2", "vocab_size": vocab, "num_hidden_layers": 4,
                "sliding_window": 8, "head_dim": 16, "query_pre_attn_scalar": 16,
                "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}  # fmt: skip
    if arch == "deepseek2lite":  # no query bottleneck, softmax routing, a dense first layer
        return {**MLA, "model_type": "deepseek_v2", "vocab_size": vocab, "q_lora_rank": None,
                "num_experts_per_tok": 2, "first_k_dense_replace": 1, "n_shared_experts": 2,
                "routed_scaling_factor": 1.0, "scoring_func": "softmax"}  # fmt: skip
    # value heads of 32: a Q8_0 block (32 columns) is one head of ssm_out, so the tests can
    # move quantized columns by heads as a real model's 128-wide heads move
    # (a small file: one DeltaNet layer, then the attention layer transformers' MtpModel needs last)
    base = {
        **QWEN3_NEXT,
        "vocab_size": vocab,
        "linear_value_head_dim": 32,
        "num_hidden_layers": 2,
        "layer_types": ["linear_attention", "full_attention"],
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 32,
    }
    if arch == "qwen35":
        return {
            **{k: v for k, v in base.items() if "expert" not in k},
            "model_type": "qwen3_5_text",
        }
    return {**base, "model_type": "qwen3_5_moe_text" if arch == "qwen35moe" else "qwen3_next"}


def make(arch: str, path: Path, vocab: int) -> None:
    from hf_models import make_tiny
    from mtp_models import make_nextn, make_qwen_mtp

    settings = spec(arch, vocab)
    if arch in NO_MTP:
        make_tiny(path, perturb_vectors=True, **settings)
    elif arch.startswith("qwen"):
        make_qwen_mtp(path, settings)
    else:
        make_nextn(path, settings)


def convert_with_llama_cpp(llama_cpp: Path, hf_dir: Path, out: Path, tokens, merges) -> str:
    """llama.cpp's converter class for the checkpoint's architecture, in float16."""
    tree = str((llama_cpp / "gguf-py").resolve())
    if tree not in sys.path:
        sys.path[:0] = [tree, str(llama_cpp)]
        for name in [m for m in sys.modules if m == "gguf" or m.startswith("gguf.")]:
            del sys.modules[name]  # the converter needs its tree's gguf-py, not the installed one
    import gguf
    import torch
    from conversion import ModelBase, ModelType, get_model_architecture, get_model_class

    hparams = ModelBase.load_hparams(hf_dir, False)
    cls = get_model_class(get_model_architecture(hparams, ModelType.TEXT), mmproj=False)

    def set_vocab(self):  # the tiny model has no tokenizer: the tests' byte-level BPE
        w = self.gguf_writer
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens)
        w.add_token_types([3] * 3 + [1] * (len(tokens) - 3))
        w.add_token_merges(merges)
        w.add_eos_token_id(2)
        w.add_add_bos_token(False)

    cls.set_vocab = set_vocab
    for inner in vars(cls).values():  # a wrapper's implementations (Mistral3Model's)
        if isinstance(inner, type) and hasattr(inner, "set_vocab"):
            inner.set_vocab = set_vocab
    with torch.inference_mode():
        model = cls(hf_dir, gguf.LlamaFileType.MOSTLY_F16, out, eager=True)
        model.write()
    try:
        commit = subprocess.run(
            ["git", "-C", str(llama_cpp), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        commit = llama_cpp.resolve().as_posix()
    return f"{cls.__name__} from {commit}"


def rounded_to_float16(hf_dir: Path, arch: str):
    """Every matrix of the saved checkpoint rounded to float16 values (kept in float32), so the
    converter's float16 file holds exactly the weights transformers runs; (trunk, MtpModel or
    None) loaded again from it as tests/support/mtp_models.py loads them."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file
    from transformers.modeling_layers import MtpModel

    file = hf_dir / "model.safetensors"
    weights = {k: v.half().float() if v.dim() > 1 else v for k, v in load_file(str(file)).items()}
    save_file(weights, str(file), metadata={"format": "pt"})
    trunk = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    if arch in NO_MTP:  # (llama.cpp's converter drops DeepSeek-V3's MTP layer)
        return trunk, None
    if arch.startswith("qwen"):
        trunk.config.num_mtp_layers = 1
        trunk.config.mtp_layer_types = ["full_attention"]
    else:
        trunk._keys_to_ignore_on_load_unexpected = [
            rf"model\.layers\.{trunk.config.num_hidden_layers}\."
        ]
        if arch == "glm4moelite":
            trunk.config.num_mtp_layers = 1
            trunk.config.mtp_mlp_layer_types = ["sparse"]
    return trunk, MtpModel.from_pretrained(trunk).eval()


def reference(trunk, mtp) -> dict:
    import torch
    from transformers.cache_utils import MtpCache

    T = len(IDS)
    with torch.no_grad():
        out = trunk(torch.tensor([IDS]), output_hidden_states=True)
        trunk.generation_config.eos_token_id = None
        greedy = trunk.generate(torch.tensor([IDS]), max_new_tokens=GREEDY, do_sample=False)
        if mtp is None:
            # and a prompt past original_max_position_embeddings (64 in the tiny RoPE-scaled
            # configs): Phi's LongRoPE switches to its long factors there
            long = [(5 + 11 * i) % trunk.config.vocab_size for i in range(LONG)]
            return {
                "ids": torch.tensor(IDS, dtype=torch.int32),
                "logits": out.logits[0].float().contiguous(),
                "greedy": greedy[0, T:].to(torch.int32).contiguous(),
                "long_ids": torch.tensor(long, dtype=torch.int32),
                "long_logits": trunk(torch.tensor([long])).logits[0, -8:].float().contiguous(),
            }
        h = out.hidden_states[-1]
        cache = MtpCache(config=trunk.config.get_mtp_config())
        g = mtp.forward_layer(
            0, h[:, :-1], torch.arange(1, T)[None], cache, input_ids=torch.tensor([IDS[1:]])
        )
        rows = [mtp._project_to_logits(g)[0]]
        for i in range(2):  # chained on its own output and greedy token
            token = int(rows[-1][-1].argmax())
            g = mtp.forward_layer(
                0, g[:, -1:], torch.tensor([[T + i]]), cache, input_ids=torch.tensor([[token]])
            )
            rows.append(mtp._project_to_logits(g)[0])
    return {
        "ids": torch.tensor(IDS, dtype=torch.int32),
        "logits": out.logits[0].float().contiguous(),
        "mtp_logits": torch.cat(rows).float().contiguous(),
        "greedy": greedy[0, T:].to(torch.int32).contiguous(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree")
    ap.add_argument("--arch", choices=ARCHS, nargs="+", default=list(ARCHS))
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    sys.path[:0] = [str(ROOT / "tests" / "support"), str(ROOT / "tests" / "gguf")]
    import torch
    import transformers
    from safetensors.torch import save_file
    from test_gguf_architectures import BPE_MERGES, BPE_TOKENS

    args.out.mkdir(parents=True, exist_ok=True)
    for arch in args.arch:
        with tempfile.TemporaryDirectory() as tmp:
            hf = Path(tmp) / "hf"
            make(arch, hf, len(BPE_TOKENS))
            trunk, mtp = rounded_to_float16(hf, arch)
            gguf_path = args.out / f"{arch}.gguf"
            made_by = convert_with_llama_cpp(args.llama_cpp, hf, gguf_path, BPE_TOKENS, BPE_MERGES)
            ref = reference(trunk, mtp)
        meta = {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "converter": made_by,
            "config": json.dumps(trunk.config.to_diff_dict(), sort_keys=True, default=str),
        }
        save_file(ref, str(args.out / f"{arch}.reference.safetensors"), metadata=meta)
        print(gguf_path, gguf_path.stat().st_size, "bytes;", made_by)


if __name__ == "__main__":
    main()
