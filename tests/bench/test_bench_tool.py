"""tools/bench_vs_mlx_lm.py: the measurement runs both engines and reports ratios of medians.

A smoke test on a tiny random llama with tiny sizes; no timing is asserted.
"""

import math

import pytest
from fixtures import load_script
from hf_models import add_tokenizer, make_tiny

from mlxinfer.loading.convert import convert


@pytest.fixture(scope="module")
def bench():
    return load_script("tools/bench_vs_mlx_lm.py")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path, _ = make_tiny(
        tmp_path_factory.mktemp("bench") / "tiny", vocab_size=320, tie_word_embeddings=True
    )
    return add_tokenizer(path)


@pytest.mark.parametrize("model", ["f32", "4bit"])
def test_measure_reports_both_engines_and_ratios_of_medians(bench, hf_dir, tmp_path, model):
    convert(hf_dir, tmp_path / model, **bench.MODELS[model])
    result = bench.measure(tmp_path / model, prompt_tokens=8, max_tokens=4, reps=2)

    assert set(result["engines"]) == {"mlxinfer", "mlx-lm"}
    assert (result["prompt_tokens"], result["max_tokens"], result["reps"]) == (8, 4, 2)
    for engine in result["engines"].values():
        assert len(engine["runs"]) == 2
        assert set(engine["median"]) == {*bench.METRICS, "rss_gb"}
        assert all(math.isfinite(v) and v > 0 for v in engine["median"].values())
    ours, theirs = result["engines"]["mlxinfer"]["median"], result["engines"]["mlx-lm"]["median"]
    assert set(result["ratios"]) == set(bench.METRICS)
    for metric, ratio in result["ratios"].items():
        assert ratio == pytest.approx(ours[metric] / theirs[metric])
    # Same weights, greedy decoding, EOS ignored: both engines produce the same tokens.
    assert result["same_tokens"]


def test_markdown_table_has_a_row_per_model_and_metric(bench):
    median = {
        "prefill_tps": 100.0,
        "decode_tps": 20.0,
        "ttft_s": 0.5,
        "peak_memory_gb": 0.25,
        "rss_gb": 1.0,
    }
    result = {
        "prompt_tokens": 8,
        "max_tokens": 4,
        "reps": 2,
        "same_tokens": True,
        "engines": {
            "mlxinfer": {"median": median},
            "mlx-lm": {"median": {**median, "decode_tps": 10.0}},
        },
        "ratios": {m: 2.0 if m == "decode_tps" else 1.0 for m in bench.METRICS},
    }
    env = {
        "mlx_lm": "x",
        "mlx": "y",
        "device": "cpu",
        "blas": "z",
        "cpus": 2,
        "load_average_1min": 0.5,
    }
    table = bench.markdown_table({"f32": result, "4bit": result}, env)
    rows = [
        line
        for line in table.splitlines()
        if line.startswith("| f32 ") or line.startswith("| 4bit ")
    ]
    assert len(rows) == 2 * len(bench.METRICS)
    assert "| f32 | decode ↑ | 20.0 tok/s | 10.0 tok/s | 2.00× |" in rows


def test_unknown_model_name_is_a_usage_error(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--models", "f32,nope"])
    assert "nope" in capsys.readouterr().err
