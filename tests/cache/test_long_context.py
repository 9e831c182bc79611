"""tools/bench_long_context.py: KV-cache sizes, ratios and greedy divergence, on a tiny model.

The real run (SmolLM2 at ~8k tokens, minutes on a CPU) is in docs/long-context.md; here the
same code runs on a tiny random llama with a short prompt, and its numbers are
checked against what they must be by construction.
"""

import json

import pytest
from fixtures import load_script
from hf_models import CORPUS, add_tokenizer, make_tiny

from mlxinfer.loading.convert import convert

# head_dim 64 (one quantization group of 64 per head), 1 KV head, 2 layers
TINY = {
    "hidden_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 256,
    "vocab_size": 320,
    "tie_word_embeddings": True,
}
PROMPT, NEW = 200, 6


@pytest.fixture(scope="module")
def tool():
    return load_script("tools/bench_long_context.py")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    work = tmp_path_factory.mktemp("long-context")
    hf, _ = make_tiny(work / "hf", **TINY)
    convert(add_tokenizer(hf), work / "f32", dtype="float32")
    return work / "f32"


@pytest.fixture(scope="module")
def report(tool, model_dir, tmp_path_factory):
    """The tool's own main(), run once: (stdout table, JSON written with --json)."""
    work = tmp_path_factory.mktemp("report")
    (work / "doc.txt").write_text("\n".join(CORPUS))
    out = work / "out.json"
    import contextlib
    import io

    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        tool.main(
            [
                "--model",
                str(model_dir),
                "-p",
                str(PROMPT),
                "-n",
                str(NEW),
                "--document",
                str(work / "doc.txt"),
                "--json",
                str(out),
            ]
        )
    return stdout.getvalue(), json.loads(out.read_text())


def test_first_divergence_is_the_first_differing_index(tool):
    assert tool.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert tool.first_divergence([1, 2, 3], [1, 2, 4]) == 2
    assert tool.first_divergence([5, 2, 3], [6, 2, 3]) == 0
    assert tool.first_divergence([1, 2, 3], [1, 9, 4]) == 1  # the first one, not the last
    assert tool.first_divergence([1, 2], [1, 2, 3]) == 2  # a missing token differs


def test_quantized_ratio_is_codes_plus_scale_and_bias_over_float(tool):
    assert tool.quantized_ratio(8, 64, 32) == (8 * 64 + 2 * 32) / (32 * 64) == 0.28125
    assert tool.quantized_ratio(8, 64, 16) == (8 * 64 + 2 * 16) / (
        16 * 64
    )  # float16 scales on a Mac
    assert (
        tool.quantized_ratio(8, 64, 16, scale_bits=32) == 0.5625
    )  # our f32 run vs a float16 cache


def test_prompt_fits_and_ends_by_asking_the_question(tool, model_dir):
    from mlxinfer.tokenization import Tokenizer

    tokenizer = Tokenizer.from_dir(model_dir)
    document = "\n".join(CORPUS)
    for n in (40, 80, 200):
        ids = tool.build_prompt(tokenizer, document, n, question="Sum up.")
        assert n - 40 <= len(ids) <= n  # cut back to whole lines, so a little short of n
        assert tokenizer.decode(ids).endswith("Sum up.<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="too few"):
        tool.build_prompt(tokenizer, document, 5)


def test_kv_bytes_ratios_are_the_derived_values(report, model_dir):
    _, data = report
    result = data["result"]
    float_run, q8, q4 = result["runs"]
    assert [r["cache"] for r in result["runs"]] == ["float32", "8-bit g64", "4-bit g64"]
    assert PROMPT - 40 <= result["prompt_tokens"] <= PROMPT  # cut back to whole lines
    # Every fed token is cached: the prompt and all generated tokens but the last.
    tokens = result["prompt_tokens"] + NEW - 1
    layers, kv_heads, head_dim = 2, 1, 64
    assert float_run["kv_bytes"] == 2 * layers * kv_heads * head_dim * tokens * 4
    assert float_run["kv_float16_bytes"] == float_run["kv_bytes"] // 2
    assert (q8["kv_dtype"], q4["kv_dtype"]) == (
        "float32",
        "float32",
    )  # scales and biases follow the activations
    # Per group of 64 values: 8·64 bits of codes + a float32 scale and bias, vs 64 float32 values.
    c8, c4 = result["comparisons"]["8-bit g64"], result["comparisons"]["4-bit g64"]
    assert c8["kv_bytes_vs_float"] == (8 * 64 + 2 * 32) / (32 * 64)
    assert c8["kv_bytes_vs_float16"] == (8 * 64 + 2 * 32) / (16 * 64)
    assert c4["kv_bytes_vs_float"] == (4 * 64 + 2 * 32) / (32 * 64)
    for c, run in ((c8, q8), (c4, q4)):
        assert c["peak_rise_vs_float"] == run["peak_rise_bytes"] / float_run["peak_rise_bytes"]
        assert (
            run["peak_memory_bytes"] - run["peak_rise_bytes"] >= result["weight_bytes"]
        )  # weights resident
        assert len(run["tokens"]) == NEW and run["ttft_s"] > 0 and run["decode_tps"] > 0


def test_identical_tokens_and_divergence_agree_with_the_token_lists(report):
    _, data = report
    result = data["result"]
    ref = result["runs"][0]["tokens"]
    for run in result["runs"][1:]:
        c = result["comparisons"][run["cache"]]
        at = next((i for i, (a, b) in enumerate(zip(ref, run["tokens"])) if a != b), None)
        if at is None:
            assert c["identical_tokens"] == NEW and c["divergence"] is None
        else:
            assert c["identical_tokens"] == at == c["divergence"]["position"]
            assert (c["divergence"]["float_token"], c["divergence"]["token"]) == (
                ref[at],
                run["tokens"][at],
            )
        # Teacher forcing: this cache's greedy choice at each step of the float run's continuation.
        assert len(run["forced_tokens"]) == NEW
        assert c["forced_agreement"] == sum(a == b for a, b in zip(run["forced_tokens"], ref))


def test_one_pass_over_the_float_tokens_picks_them_again(report):
    # The teacher-forced pass (all continuation tokens at once, on the rewound cache) is the
    # same computation as the step-by-step decode, so the float cache agrees with itself.
    _, data = report
    result = data["result"]
    assert result["float_forced_agreement"] == NEW
    assert result["runs"][0]["forced_tokens"] == result["runs"][0]["tokens"]
    assert len(result["float_top2_gaps"]) == NEW and min(result["float_top2_gaps"]) >= 0


def test_table_has_a_row_per_cache_and_the_verdicts(report):
    table, _ = report
    rows = [line for line in table.splitlines() if line.startswith("| ") and "KV cache" not in line]
    assert [r.split(" | ")[0] for r in rows] == [
        "| float32",
        "| float16 (computed, not run)",
        "| 8-bit g64",
        "| 4-bit g64",
    ]
    assert "0.281× the float32 cache run (met), 0.562× a float16 cache (met)" in table
    assert f"cannot tell ({NEW} generated)" in table  # fewer than 32 tokens: no verdict


def test_a_divergence_is_reported_with_both_tokens(tool, report):
    _, data = report
    result = json.loads(json.dumps(data["result"]))
    c8 = result["comparisons"]["8-bit g64"]
    result["runs"][0]["tokens"] = list(range(40))
    c8.update(
        identical_tokens=3,
        divergence={
            "position": 3,
            "float_token": 3,
            "float_text": " Paris",
            "token": 7,
            "text": " London",
            "common_prefix_text": "x",
            "float_margin": 0.05,
            "margin": 0.125,
        },
    )
    result["float_top2_gaps"] = [0.05] + [2.0] * 39
    table = tool.markdown_table(result, data["environment"])
    assert (
        "- 8-bit g64: first 3 tokens identical; at token 3 the float cache gives 3 ' Paris', "
        "this one 7 ' London' (log-prob margin between the two: 0.050 for the float cache's choice "
        "under the float cache, 0.125 for this one's under this one)." in table
    )
    assert "smallest 0.050; 1 of 40 under 0.1" in table
    assert "≥ 32 leading greedy tokens identical: 3 — NOT met (40 generated)." in table
