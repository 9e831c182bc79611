"""The peers' rows of docs/quality.md: mlx-lm's and llama.cpp's quantizations of a model, scored
against its float32 reference on the same tokens by ``mlxinfer perplexity``.

For each model (``smollm2``: SmolLM2-135M-Instruct from its Q4_1 GGUF; ``gemma3``: Gemma-3-270M
from its Q4_K_M GGUF, both in the test-model cache):

1. the float32 reference: ``mlxinfer convert <gguf> -o WORK/<model>/f32 --dtype float32`` (or
   ``--reference-<model> DIR``, an existing one);
2. mlx-lm's input: the reference's files linked into WORK/<model>/mlxlm-src with a config.json
   that also carries the top-level keys mlx-lm reads (it ignores transformers 5's
   ``rope_parameters``): ``rope_theta``, and for Gemma 3 ``rope_local_base_freq`` and
   ``sliding_window_pattern``;
3. mlx-lm (``mlx_lm.convert(hf_path=..., quantize=True, dtype="bfloat16", ...)``, one child
   process each; bfloat16 is what mlx-lm does with both models' published checkpoints, whose
   ``torch_dtype`` is bfloat16): uniform 4-bit group 64 (its default), 3-bit group 64,
   ``mixed_4_6``, ``mixed_3_6`` (group 64), ``mxfp4``; and 4-bit group 64 read as the float32
   reference is (``dtype`` left to the config: float32 scales and biases);
4. llama.cpp (llama-cpp-python in its own virtual environment, ``--llama-python``; mlxinfer never
   imports it): ``llama_model_quantize`` with ``llama_model_quantize_default_params()``,
   ``allow_requantize=True``, no imatrix, from the model's GGUF, for Q4_K_M, Q3_K_M, IQ4_XS,
   Q4_K_S, Q5_K_M, Q8_0;
5. ``mlxinfer perplexity -m ... --reference F32 --json`` (the shipped evaluation corpus, 16 chunks
   of 512 tokens): one call for the mlx-lm outputs, one for the GGUFs our import reads (each
   GGUF is imported first on its own; one that fails is recorded with its one-line error);
   the reports go to OUT/<model>-mlxlm.json and OUT/<model>-llamacpp.json, each output's size
   and tensor types to OUT/<model>-files.json;
6. ``--table``: the markdown rows of docs/quality.md from those files.

    python3 -m venv /tmp/peers/llama-venv
    CMAKE_BUILD_PARALLEL_LEVEL=2 CMAKE_ARGS="-DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON \\
      -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON \\
      -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF \\
      -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" /tmp/peers/llama-venv/bin/pip install \\
      --no-binary llama-cpp-python --no-cache-dir llama-cpp-python==0.3.36
    python tools/quality_peers.py --work /tmp/peers --llama-python /tmp/peers/llama-venv/bin/python \\
      --reference-smollm2 /tmp/q/f32 --out docs/quality
    python tools/quality_peers.py --out docs/quality --table

Takes about an hour on 2 cores (the llama-cpp-python build another 10 minutes); every step
whose output exists is skipped, so a run can be resumed. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import mmap
import os
import re
import struct
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

CACHE = Path.home() / ".cache/mlxinfer-tests"
MODELS = {
    "smollm2": CACHE / "smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3": CACHE / "gemma3-270m-q4_k_m-1.0.0/gemma-3-270m-q4_k_m.gguf",
}
TITLES = {"smollm2": "SmolLM2-135M-Instruct", "gemma3": "Gemma-3-270M (base)"}
SOURCE_RECIPE = {"smollm2": "Q4_1 (the source GGUF)", "gemma3": "Q4_K_M (the source GGUF)"}

# name -> (label in the table, keyword arguments of mlx_lm.convert)
MLX_LM = {
    "4bit-g64": ("4-bit g64 (default)", {"q_bits": 4, "q_group_size": 64}),
    "3bit-g64": ("3-bit g64", {"q_bits": 3, "q_group_size": 64}),
    "mixed_4_6": ("mixed_4_6", {"quant_predicate": "mixed_4_6", "q_group_size": 64}),
    "mixed_3_6": ("mixed_3_6", {"quant_predicate": "mixed_3_6", "q_group_size": 64}),
    "mxfp4": ("mxfp4", {"q_mode": "mxfp4"}),
    "4bit-g64-f32": ("4-bit g64, float32 scales", {"q_bits": 4, "q_group_size": 64}),
}
LLAMA_CPP = ["Q4_K_M", "Q3_K_M", "IQ4_XS", "Q4_K_S", "Q5_K_M", "Q8_0"]

CONVERT_CHILD = """
import json, sys
from mlx_lm import convert
kw = json.loads(sys.argv[1])
convert(**kw)
"""

QUANTIZE_CHILD = """
import ctypes, sys
import llama_cpp
src, dst, ftype = sys.argv[1], sys.argv[2], sys.argv[3]
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + ftype)
p.allow_requantize = True
p.nthread = 2
rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(p))
print("llama-cpp-python", llama_cpp.__version__, "rc", rc)
sys.exit(0 if rc == 0 else 1)
"""

IMPORT_CHILD = """
import sys
from mlxinfer.loading.gguf_files import model_dir_for
print(model_dir_for(sys.argv[1]))
"""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(args: list[str], **kw) -> subprocess.CompletedProcess:
    log("+ " + " ".join(str(a) for a in args))
    t = time.time()
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, **kw)
    log(f"  rc {done.returncode} in {time.time() - t:.0f} s")
    return done


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


def reference(model: str, work: Path, given: Path | None) -> Path:
    if given is not None:
        return given
    out = work / model / "f32"
    if not (out / "config.json").exists():
        done = run(["mlxinfer", "convert", MODELS[model], "-o", out, "--dtype", "float32"])
        if done.returncode:
            sys.exit(done.stderr[-2000:])
    return out


def mlx_lm_source(model: str, ref: Path, work: Path) -> Path:
    """The reference's files, linked, with a config.json mlx-lm reads its rope bases from."""
    src = work / model / "mlxlm-src"
    src.mkdir(parents=True, exist_ok=True)
    for f in ref.iterdir():
        if f.name != "config.json" and not (src / f.name).exists():
            (src / f.name).symlink_to(f.resolve())
    config = json.loads((ref / "config.json").read_text())
    rope = config.get("rope_parameters") or {}
    if "full_attention" in rope:  # Gemma 3: one base per attention kind
        config["rope_theta"] = rope["full_attention"]["rope_theta"]
        config["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
        kinds = config["layer_types"]
        period = kinds.index("full_attention") + 1
        expected = [
            "full_attention" if (i + 1) % period == 0 else "sliding_attention"
            for i in range(len(kinds))
        ]
        assert kinds == expected, "layer_types is not a periodic pattern mlx-lm can express"
        config["sliding_window_pattern"] = period
    elif "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    assert "rope_theta" in config, f"{ref}: no rope_theta for mlx-lm"
    (src / "config.json").write_text(json.dumps(config, indent=2))
    return src


def mlx_lm_outputs(model: str, src: Path, work: Path) -> dict[str, Path]:
    outs = {}
    for name, (_, kw) in MLX_LM.items():
        dst = work / model / "mlxlm" / name
        if not (dst / "config.json").exists():
            args = dict(kw, hf_path=str(src), mlx_path=str(dst), quantize=True)
            if not name.endswith("-f32"):
                args["dtype"] = "bfloat16"
            done = run([sys.executable, "-c", CONVERT_CHILD, json.dumps(args)])
            if done.returncode:
                log(f"  mlx-lm {name} failed: {last_line(done.stderr)}")
                continue
        outs[name] = dst
    return outs


def llama_cpp_outputs(model: str, work: Path, llama_python: str | None, failures: dict):
    outs = {}
    for qt in LLAMA_CPP:
        dst = work / model / "llamacpp" / f"{model}.{qt}.gguf"
        if not dst.exists():
            if llama_python is None:
                failures[qt] = "not made: no --llama-python"
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            done = run([llama_python, "-c", QUANTIZE_CHILD, MODELS[model], dst, qt])
            (dst.parent / f"{qt}.log").write_text(done.stdout + done.stderr)
            if done.returncode:
                dst.unlink(missing_ok=True)
                failures[qt] = "llama.cpp refused: " + last_line(done.stderr or done.stdout)
                continue
        outs[qt] = dst
    return outs


# ggml type code -> (name, values per block, bytes per block), for sizes only
GGML_TYPES = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    20: ("IQ4_NL", 32, 18),
    23: ("IQ4_XS", 256, 136),
    30: ("BF16", 1, 2),
}


def gguf_summary(path: Path) -> dict:
    """The file's size, its tensors' bytes, and tensors and bytes per type (a small reader of
    the header of our own: mlxinfer's refuses the types it does not import)."""
    scalar = {
        0: "B",
        1: "b",
        2: "H",
        3: "h",
        4: "I",
        5: "i",
        6: "f",
        7: "?",
        10: "Q",
        11: "q",
        12: "d",
    }
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        pos = 4

        def take(fmt):
            nonlocal pos
            v = struct.unpack_from("<" + fmt, buf, pos)
            pos += struct.calcsize("<" + fmt)
            return v[0]

        def string():
            nonlocal pos
            n = take("Q")
            pos += n
            return bytes(buf[pos - n : pos]).decode("utf-8", "replace")

        def value(code):
            if code == 8:
                return string()
            if code == 9:
                inner, n = take("I"), take("Q")
                return [value(inner) for _ in range(n)]
            return take(scalar[code])

        assert bytes(buf[:4]) == b"GGUF" and take("I") in (2, 3), f"{path}: not a GGUF v2/v3"
        n_tensors, n_kv = take("Q"), take("Q")
        for _ in range(n_kv):
            string()
            value(take("I"))
        per_type, type_bytes, total = Counter(), Counter(), 0
        for _ in range(n_tensors):
            string()
            dims = [take("Q") for _ in range(take("I"))]
            name, block, size = GGML_TYPES[take("I")]
            take("Q")  # offset
            count = 1
            for d in dims:
                count *= d
            nbytes = count // block * size
            per_type[name] += 1
            type_bytes[name] += nbytes
            total += nbytes
    return {
        "file_bytes": path.stat().st_size,
        "tensor_bytes": total,
        "types": dict(per_type.most_common()),
        "type_bytes": dict(type_bytes.most_common()),
    }


def dir_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.glob("model*.safetensors"))


def score(models: list[Path], ref: Path, out: Path, chunks: int) -> None:
    if out.exists() or not models:
        return
    done = run(
        [
            "mlxinfer",
            "perplexity",
            *[a for m in models for a in ("-m", m)],
            "--reference",
            ref,
            "--json",
            "--chunks",
            chunks,
        ]
    )
    if done.returncode:
        sys.exit(f"perplexity failed: {done.stderr[-3000:]}")
    out.write_text(done.stdout)


def produce(a) -> None:
    work, out = a.work, a.out
    out.mkdir(parents=True, exist_ok=True)
    for model in a.models:
        given = getattr(a, f"reference_{model}")
        ref = reference(model, work, given)
        failures: dict[str, str] = {}
        mlx = mlx_lm_outputs(model, mlx_lm_source(model, ref, work), work)
        ggufs = {
            "source": MODELS[model],
            **llama_cpp_outputs(model, work, a.llama_python, failures),
        }
        files = {"reference": str(ref), "outputs": {}, "failures": failures}
        for name, d in mlx.items():
            files["outputs"][str(d)] = {"tool": "mlx-lm", "recipe": name, "bytes": dir_bytes(d)}
        loadable = []
        for qt, g in ggufs.items():
            info = {"tool": "llama.cpp" if qt != "source" else "source", "recipe": qt}
            info.update(gguf_summary(g))
            if qt != "source" and filecmp.cmp(g, MODELS[model], shallow=False):
                info["identical_to_source"] = True  # scored once, as the source
                files["outputs"][str(g)] = info
                continue
            done = run([sys.executable, "-c", IMPORT_CHILD, g])
            if done.returncode:
                failures[qt] = "mlxinfer import: " + last_line(done.stderr)
            else:
                loadable.append(g)
                info["import_dir"] = last_line(done.stdout)
                info["import_bytes"] = dir_bytes(Path(info["import_dir"]))
            files["outputs"][str(g)] = info
        (out / f"{model}-files.json").write_text(json.dumps(files, indent=2))
        score(list(mlx.values()), ref, out / f"{model}-mlxlm.json", a.chunks)
        score(loadable, ref, out / f"{model}-llamacpp.json", a.chunks)


def table(out: Path, model: str) -> str:
    files = json.loads((out / f"{model}-files.json").read_text())
    rows, ref = [], None
    for group in ("mlxlm", "llamacpp"):
        p = out / f"{model}-{group}.json"
        if not p.exists():
            continue
        report = json.loads(p.read_text())
        ref = report["reference"]
        for s in report["models"]:
            info = files["outputs"][s["model"]]
            if info["tool"] == "mlx-lm":
                label, size = MLX_LM[info["recipe"]][0], s["bytes"]
            else:
                label = SOURCE_RECIPE[model] if info["tool"] == "source" else info["recipe"]
                size = info["tensor_bytes"]
            rows.append((size, label, info["tool"], s))
    source = next((r for r in rows if r[2] == "source"), None)
    for info in files["outputs"].values():
        if info.get("identical_to_source") and source is not None:
            label = f"{info['recipe']} (byte-identical to the source: the same scores)"
            rows.append((info["tensor_bytes"], label, info["tool"], source[3]))
    params = ref["parameters"]
    lines = [
        "| recipe | tool | MB on disk | bits per weight | PPL | ΔPPL % | mean KLD ± SE | KLD p99 "
        "| top-1 % |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        f"| float32 reference | mlxinfer convert | {ref['bytes'] / 1e6:.1f} | "
        f"{ref['bytes'] * 8 / params:.2f} | {ref['ppl']:.3f} | – | – | – | – |",
    ]
    body = []
    for size, label, tool, s in rows:
        body.append(
            (
                size,
                (
                    f"| {label} | {tool} | {size / 1e6:.1f} | {size * 8 / params:.2f} | {s['ppl']:.3f} | "
                    f"{s['delta_ppl_pct']:+.2f} | {s['kld']:.4f} ± {s['kld_se']:.4f} | "
                    f"{s['kld_p99']:.3f} | {s['top1_pct']:.2f} |"
                ),
            )
        )
    for qt, why in files["failures"].items():
        size = next(
            (i["tensor_bytes"] for i in files["outputs"].values() if i.get("recipe") == qt), None
        )
        shown = f"{size / 1e6:.1f} | {size * 8 / params:.2f}" if size else "– | –"
        if m := re.search(r"unsupported type (\S+)", why):
            why = f"our GGUF import does not read {m.group(1)}"
        body.append((size or 0, f"| {qt} | llama.cpp | {shown} | not scored: {why} | | | | |"))
    lines += [line for _, line in sorted(body, key=lambda r: r[0])]
    lines.append("| <!-- mlxinfer rows --> | | | | | | | | |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/peers"))
    ap.add_argument("--out", type=Path, default=Path("docs/quality"))
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    for m in MODELS:
        ap.add_argument(
            f"--reference-{m}",
            type=Path,
            default=None,
            help=f"an existing float32 reference directory of {m}",
        )
    ap.add_argument(
        "--llama-python",
        default=None,
        help="the Python of a virtual environment with llama-cpp-python",
    )
    ap.add_argument("--chunks", default="16")
    ap.add_argument("--table", action="store_true", help="print the tables from --out and stop")
    a = ap.parse_args()
    if a.table:
        for m in a.models:
            if (a.out / f"{m}-files.json").exists():
                print(f"\n### {TITLES[m]}\n\n{table(a.out, m)}")
        return
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    produce(a)


if __name__ == "__main__":
    main()
