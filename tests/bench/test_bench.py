"""``mlxinfer bench``: what each number is, checked from the JSON it writes, on a tiny random llama.

No speed is asserted (shared machines); the relations between the numbers are:
medians and spreads of the runs, prefill = p / TTFT, ratios of medians, and
bytes per decoded token derived from the checkpoint file and config.
"""

import ast
import json
import os
import statistics
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner
from hf_models import add_tokenizer, make_tiny

from mlxinfer import bench as b
from mlxinfer.bench import report as bench_report
from mlxinfer.cli.main import cli
from mlxinfer.loading.convert import convert

P, N, REPS = (8, 16), 4, 2
METRICS = ("prefill_tps", "decode_tps", "ttft_s", "peak_memory_gb")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny llama with an untied head (the roofline counts only one embedding row), converted at f32.

    head_dim 64: the quantized KV cache groups 64 values.
    """
    root = tmp_path_factory.mktemp("bench")
    path, _ = make_tiny(
        root / "hf",
        vocab_size=320,
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    add_tokenizer(path)
    convert(path, root / "mlx", dtype="float32")
    return root / "mlx"


@pytest.fixture(scope="module")
def compared(model_dir, tmp_path_factory):
    """One full run: two prompt lengths, mlx-lm alongside, JSON and plot."""
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (the bench and test extras)")
    out = tmp_path_factory.mktemp("out")
    args = [
        "bench",
        "-m",
        str(model_dir),
        "-p",
        ",".join(map(str, P)),
        "-n",
        str(N),
        "--reps",
        str(REPS),
        "--compare",
        "mlx-lm",
        "--json",
        str(out / "b.json"),
        "--plot",
        str(out / "b.png"),
    ]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    return result, json.loads((out / "b.json").read_text()), out


def test_json_has_environment_settings_and_every_run(compared, model_dir):
    _, data, _ = compared
    assert {
        "platform",
        "python",
        "mlx",
        "device",
        "blas",
        "cpus",
        "load_average_1min",
        "mlx_lm",
    } <= set(data["environment"])
    assert data["model"] == str(model_dir)
    assert data["settings"] == {
        "prompt_tokens": list(P),
        "max_tokens": N,
        "reps": REPS,
        "kv_bits": None,
        "prefill_step": None,
        "compare": "mlx-lm",
    }
    assert [e["prompt_tokens"] for e in data["results"]] == list(P)
    for entry in data["results"]:
        assert set(entry["engines"]) == {"mlxinfer", "mlx-lm"}
        for summary in entry["engines"].values():
            assert len(summary["runs"]) == REPS
            for m in METRICS:
                values = [r[m] for r in summary["runs"]]
                assert all(v > 0 for v in values)
                assert summary["median"][m] == pytest.approx(statistics.median(values))
                assert summary["spread"][m] == pytest.approx([min(values), max(values)])


def test_prefill_is_prompt_tokens_over_ttft_for_every_run(compared):
    _, data, _ = compared
    for entry in data["results"]:
        for summary in entry["engines"].values():
            for run in summary["runs"]:
                assert run["prefill_tps"] == pytest.approx(entry["prompt_tokens"] / run["ttft_s"])


def test_ratios_are_our_medians_over_mlx_lm_medians(compared):
    _, data, _ = compared
    for entry in data["results"]:
        ours, theirs = (entry["engines"][e]["median"] for e in ("mlxinfer", "mlx-lm"))
        assert set(entry["ratios"]) == set(METRICS)
        for m in METRICS:
            assert entry["ratios"][m] == pytest.approx(ours[m] / theirs[m])


def _safetensors_data_bytes(path: Path) -> int:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return sum(
        t["data_offsets"][1] - t["data_offsets"][0]
        for k, t in header.items()
        if k != "__metadata__"
    )


def test_roofline_bytes_per_token_from_the_checkpoint(compared, model_dir):
    _, data, _ = compared
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False
    f32 = 4
    # Every weight once, but only one row of the (untied) token embedding table.
    weights = _safetensors_data_bytes(model_dir / "model.safetensors")
    weights -= (cfg["vocab_size"] - 1) * cfg["hidden_size"] * f32
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    for entry in data["results"]:
        p, r = entry["prompt_tokens"], entry["roofline"]
        context = p + N / 2  # decode steps attend over p+1 .. p+N-1 tokens
        kv = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * context * f32
        assert r["mean_context"] == context
        assert r["weight_bytes"] == weights
        assert r["kv_bytes"] == pytest.approx(kv)
        assert r["bytes_per_token"] == pytest.approx(weights + kv)
        assert r["limit_tps"] == pytest.approx(data["bandwidth"]["gb_per_s"] * 1e9 / (weights + kv))
        assert r["decode_tps"] == entry["engines"]["mlxinfer"]["median"]["decode_tps"]
        assert r["fraction"] == pytest.approx(r["decode_tps"] / r["limit_tps"])
    assert data["bandwidth"]["gb_per_s"] > 0
    assert "MLX sum" in data["bandwidth"]["probe"] or "numpy" in data["bandwidth"]["probe"]


def test_stdout_is_the_tables_and_the_plot_a_png(compared):
    result, _, out = compared
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    for p in P:
        assert any(line.startswith(f"| mlxinfer | {p} | ") for line in rows)
        assert any(line.startswith(f"| mlx-lm | {p} | ") for line in rows)
        assert sum(line.startswith(f"| {p} | ") for line in rows) == 2  # ratios and roofline
    assert "p=8" not in result.stdout  # progress went to stderr
    assert (out / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(f.name for f in out.iterdir()) == ["b.json", "b.png"]  # no temporary files left


def test_kv_bits_quantizes_our_cache(model_dir, tmp_path):
    out = tmp_path / "kv.json"
    result = CliRunner().invoke(
        cli,
        [
            "bench",
            "-m",
            str(model_dir),
            "-p",
            "8",
            "-n",
            "4",
            "--reps",
            "1",
            "--kv-bits",
            "8",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    r = data["results"][0]["roofline"]
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    float_kv = (
        2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * r["mean_context"] * 4
    )
    assert 0 < r["kv_bytes"] < float_kv / 2  # 8-bit codes plus a scale and bias per group
    assert data["settings"]["kv_bits"] == 8 and "mlx-lm" not in data["results"][0]["engines"]


def test_prefill_step_size_reaches_both_engines(model_dir, tmp_path, monkeypatch):
    import mlxinfer.generation.loop as generation

    steps = []
    original = generation.prefill

    def spy(model, pc, ids, step=512, **kw):
        steps.append(step)
        return original(model, pc, ids, step, **kw)

    monkeypatch.setattr(generation, "prefill", spy)
    out = tmp_path / "s.json"
    result = CliRunner().invoke(
        cli,
        [
            "bench",
            "-m",
            str(model_dir),
            "-p",
            "8",
            "-n",
            "2",
            "--reps",
            "1",
            "--prefill-step-size",
            "3",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert steps and set(steps) == {3}
    assert json.loads(out.read_text())["settings"]["prefill_step"] == 3
    assert b.mlx_lm_command(Path("/m"), 64, 8, 3, 256)[-2:] == ["--prefill-step-size", "256"]


def test_kv_bits_with_compare_notes_mlx_lms_float_cache(model_dir):
    from mlxinfer import load

    model, _ = load(model_dir)
    notes = b.comparison_notes(model, model_dir, 4)
    assert any("float cache" in n for n in notes)
    table = bench_report.tables(
        {
            "environment": b.environment(None),
            "model": "m",
            "notes": notes,
            "settings": {"max_tokens": 4, "reps": 1, "kv_bits": 4, "compare": None},
            "bandwidth": {"gb_per_s": 1.0, "probe": "x"},
            "results": [],
        }
    )
    assert "mlx-lm ran with its float cache" in table


def test_a_float16_checkpoint_on_the_cpu_is_noted(model_dir, tmp_path):
    import mlx.core as mx

    from mlxinfer import load

    if mx.default_device() != mx.cpu:
        pytest.skip("only the CPU backend widens float16 to float32")
    convert(model_dir, tmp_path / "f16", dtype="float16")
    model, _ = load(tmp_path / "f16")
    assert any("stores F16 floats" in n for n in b.comparison_notes(model, tmp_path / "f16", None))
    model, _ = load(model_dir)
    assert b.comparison_notes(model, model_dir, None) == []


TRIALS = """Running warmup..
Timing with prompt_tokens=64, generation_tokens=8, batch_size=1.
Trial 1:  prompt_tps=123.456, generation_tps=17.890, peak_memory=0.612, total_time=9.876
Trial 2:  prompt_tps=130.000, generation_tps=18.000, peak_memory=0.613, total_time=9.500
Averages: prompt_tps=126.728, generation_tps=17.945, peak_memory=0.613
"""


def test_parse_trials_reads_each_trial_line():
    assert b.parse_trials(TRIALS) == [
        {
            "prompt_tps": 123.456,
            "generation_tps": 17.890,
            "peak_memory": 0.612,
            "total_time": 9.876,
        },
        {"prompt_tps": 130.0, "generation_tps": 18.0, "peak_memory": 0.613, "total_time": 9.5},
    ]


def test_parse_trials_without_trials_quotes_the_output_tail():
    with pytest.raises(b.BenchError, match="Traceback.*ModuleNotFoundError: boom"):
        b.parse_trials("Traceback (most recent call last):\nModuleNotFoundError: boom\n")


def test_child_gets_our_blas_preloaded(monkeypatch):
    monkeypatch.setattr("mlxinfer.platform.blas._loaded", "/opt/lib/libopenblas.so.0")
    monkeypatch.setenv("LD_PRELOAD", "/other.so")
    assert b.child_env()["LD_PRELOAD"] == "/opt/lib/libopenblas.so.0:/other.so"
    cmd = b.mlx_lm_command(Path("/m"), 64, 8, 3)
    assert cmd[1:] == ["-m", "mlx_lm.benchmark", "--model", "/m", "-p", "64", "-g", "8", "-n", "3"]


@pytest.mark.parametrize(
    "args, option, found",
    [
        (["-p", "12,abc"], "-p/--prompt-tokens", "12,abc"),
        (["-p", "0"], "-p/--prompt-tokens", "0"),
        (["-p", ""], "-p/--prompt-tokens", ""),
        (["-n", "1"], "-n/--max-tokens", "1"),
        (["-n", "x"], "-n/--max-tokens", "x"),
        (["--reps", "0"], "--reps", "0"),
        (["--compare", "llama.cpp"], "--compare", "llama.cpp"),
    ],
)
def test_bad_input_is_one_line_naming_the_option(args, option, found):
    result = CliRunner().invoke(cli, ["bench", "-m", "/nonexistent", *args])
    assert result.exit_code in (1, 2)  # click's own Choice check is a usage error (2)
    if option != "--compare":
        assert result.exit_code == 1
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and option in lines[0] and f"found '{found}'" in lines[0], (
            result.output
        )
    else:
        assert "llama.cpp" in result.output and "mlx-lm" in result.output


def test_missing_mlx_lm_or_matplotlib_fails_before_measuring(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("mlx_lm", "matplotlib") else real(name, *a),
    )
    result = CliRunner().invoke(cli, ["bench", "-m", "/nonexistent", "--compare", "mlx-lm"])
    assert result.exit_code == 1
    assert "--compare mlx-lm: mlx-lm is not installed (pip install mlx-lm)" in result.output
    result = CliRunner().invoke(
        cli, ["bench", "-m", "/nonexistent", "--plot", str(tmp_path / "x.png")]
    )
    assert result.exit_code == 1
    assert "--plot needs matplotlib: pip install 'mlxinfer[bench]'" in result.output


def test_output_into_a_missing_directory_is_an_error(tmp_path):
    result = CliRunner().invoke(
        cli, ["bench", "-m", "/nonexistent", "--json", str(tmp_path / "no" / "b.json")]
    )
    assert result.exit_code == 1 and "--json" in result.output and "does not exist" in result.output


def test_a_failed_write_leaves_nothing(tmp_path):
    with pytest.raises(TypeError):
        bench_report.write_json({"x": object()}, tmp_path / "b.json")
    assert list(tmp_path.iterdir()) == []


def test_mlxinfer_never_imports_mlx_lm():
    root = Path(b.__file__).parent
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not any(n.split(".")[0] == "mlx_lm" for n in names), path


def test_written_files_get_ordinary_permissions(tmp_path):
    import stat

    from mlxinfer.bench.report import write_json

    umask = os.umask(0o022)
    try:
        out = write_json({"x": 1}, tmp_path / "out.json")
    finally:
        os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o644


def test_batch_bench_rows_and_derived_kv_bytes(model_dir, tmp_path):
    """``bench --batch``: a row per batch size for both engines, each of ours also against one
    ``generate`` stream's decode, the KV-bytes row derived from the config (blocks of 16 tokens
    against 8 × the longest in 256-token steps), the prefix's hits; the machine (CPU, bandwidth
    probe) named in the JSON and above the table."""
    out = tmp_path / "batch.json"
    args = ["bench", "-m", str(model_dir), "--batch", "1,2", "-p", "8", "-n", str(N), "--reps", "1"]
    result = CliRunner().invoke(cli, [*args, "--compare", "mlx-lm", "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert [r["batch"] for r in data["batches"]] == [1, 2]
    for row in data["batches"]:
        for engine in ("mlxinfer", "mlx-lm"):
            assert row[engine]["median"]["decode_tps"] > 0
    config = json.loads((model_dir / "config.json").read_text())
    per_token = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * 64 * 4
    kv = data["kv_bytes"]
    blocks = sum(-(-(n + N) // 16) for n in kv["lengths"])
    assert kv["paged_bytes"] == blocks * 16 * per_token
    longest = -(-(max(kv["lengths"]) + N) // 256) * 256
    assert kv["dense_left_padded_bytes"] == len(kv["lengths"]) * longest * per_token
    assert data["prefix"]["second_cached_tokens"] == 1000 // 16 * 16
    assert "mlxinfer / mlx-lm aggregate decode: batch 1:" in result.output
    stream = data["generate"]["median"]["decode_tps"]  # one generate stream, the user's baseline
    two = data["batches"][1]["mlxinfer"]["median"]["decode_tps"]
    assert stream > 0 and f"| 2 | mlxinfer | {two:.1f} |" in result.output
    assert f"| {two / stream:.2f}× |" in result.output
    assert (
        f"one `generate` stream (the same prompt length and tokens, its own cache): {stream:.1f}"
        in result.output
    )
    assert data["environment"]["cpus"] == os.cpu_count() and data["bandwidth"]["gb_per_s"] > 0
    assert f"memory bandwidth {data['bandwidth']['gb_per_s']:.1f} GB/s" in result.output


def test_batch_bench_takes_its_columns_in_rounds(monkeypatch):
    """``bench --batch``'s repetitions go in rounds, each every batch size then one ``generate``
    stream (after one warm-up of each), so that other work on a shared machine weighs on every
    column alike; each column's figures are its own runs'."""
    from mlxinfer.bench import batch as bench_batch
    from mlxinfer.bench.common import Run

    order = []

    def run(rate: float) -> Run:
        return Run(ttft_s=0.1, prefill_tps=1.0, decode_tps=rate, peak_memory_gb=0.0, total_s=1.0)

    def time_batch(model, prompts, max_tokens, kv_bits=None):
        order.append(f"batch {len(prompts)}")
        return run(10.0 * len(prompts) + len(order))

    def time_run(model, ids, max_tokens, kv_bits, prefill_step=None):
        order.append("stream")
        return run(1.0 + len(order)), None

    monkeypatch.setattr(bench_batch, "time_batch", time_batch)
    monkeypatch.setattr(bench_batch, "time_run", time_run)
    for name in ("kv_bytes_row", "newcomer_ttft", "prefix_ttft"):
        monkeypatch.setattr(bench_batch, name, lambda *a, **k: {})
    monkeypatch.setattr("mlxinfer.bench.bandwidth.measure_bandwidth", lambda: (1.0, "probe"))

    class Model:
        class args:
            vocab_size = 64

    result = bench_batch.run_batch_benchmark(
        Model(), Path("."), [1, 8], 4, 2, reps=3, compare=None, log=lambda *a: None
    )
    rounds = ["batch 1", "batch 8", "stream"]
    assert order == rounds * 4  # the warm-ups, then three rounds
    # batch 8's runs were calls 5, 8 and 11 (rates 85, 88, 91), the stream's 6, 9, 12
    assert result["batches"][1]["mlxinfer"]["median"]["decode_tps"] == 88.0
    assert result["generate"]["median"]["decode_tps"] == 10.0


def test_batch_bench_quantizes_the_pool_with_kv_bits(model_dir, tmp_path):
    """``bench --batch --kv-bits 8``: every engine's pool 8-bit, so the KV-bytes row counts a
    token's packed bytes (per layer, side and KV head: 64 codes of a byte, a float32 scale and
    bias per group of 64), and the table says so."""
    out = tmp_path / "batch.json"
    args = ["bench", "-m", str(model_dir), "--batch", "2", "-p", "8", "-n", str(N), "--reps", "1"]
    result = CliRunner().invoke(cli, [*args, "--kv-bits", "8", "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["kv_bits"] == 8 and data["batches"][0]["mlxinfer"]["median"]["decode_tps"] > 0
    config = json.loads((model_dir / "config.json").read_text())
    per_token = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * (64 + 2 * 4)
    kv = data["kv_bytes"]
    assert kv["paged_bytes"] == sum(-(-(n + N) // 16) for n in kv["lengths"]) * 16 * per_token
    assert "tokens each, mlxinfer's keys and values 8-bit" in result.output


def test_batch_bench_takes_one_prompt_length(model_dir):
    result = CliRunner().invoke(cli, ["bench", "-m", str(model_dir), "--batch", "2", "-p", "8,16"])
    assert result.exit_code == 2 and "--batch takes one prompt length" in result.output
