"""Distributed inference (mlxinfer/distributed) on MLX's ring backend: two ranks on 127.0.0.1.

Each test starts one process per rank with MLX's own environment (MLX_RANK, MLX_HOSTFILE with
free ports), as ``mlx.launch`` would, every wait bounded and the ranks killed in a ``finally``.
The reference is transformers on the same tiny random checkpoint; the faults are a rank
killed (SIGKILL) or stopped (SIGSTOP) mid-generation.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
RANK_SCRIPT = Path(__file__).resolve().parents[1] / "support" / "distributed_rank.py"
PROMPT = [1, 5, 9, 30, 7, 44]
N_TOKENS = 8
WAIT_S = 60  # the most any one run of two ranks may take here (2 shared cores)


SLOW_LAUNCH = pytest.mark.skipif(
    os.environ.get("MLXINFER_SLOW") != "1",
    reason="one more two-rank launch than the suite's share: set MLXINFER_SLOW=1 to run",
)


def _checkpoint(path: Path, **overrides):
    """A tiny random llama (transformers) with a tokenizer; EOS rows of the head zeroed, so
    greedy decoding never ends early (the fault tests need a long generation)."""
    import torch
    from hf_models import make_tiny
    from tiny_checkpoint import tokenizer_json

    config = dict(vocab_size=300, num_hidden_layers=3, max_position_embeddings=32768)
    _, model = make_tiny(path, "llama", **{**config, **overrides})
    with torch.no_grad():
        model.lm_head.weight[:3] = 0  # <s>, </s>, <|im_end|>: logit 0, below the maximum
    model.save_pretrained(path, safe_serialization=True)
    (path / "tokenizer.json").write_text(json.dumps(tokenizer_json(300)))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"})
    )
    return path, model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """4 heads, 2 KV heads, 3 layers (2 + 1 over two ranks): both splits apply. Sharded in
    two files with no index file."""
    import mlx.core as mx

    path, model = _checkpoint(tmp_path_factory.mktemp("llama"))
    weights = mx.load(str(path / "model.safetensors"))
    first = {k: v for k, v in weights.items() if k.startswith("model.layers.0.")}
    mx.save_safetensors(str(path / "part-1.safetensors"), first)
    rest = {k: v for k, v in weights.items() if k not in first}
    mx.save_safetensors(str(path / "part-2.safetensors"), rest)
    (path / "model.safetensors").unlink()
    assert not list(path.glob("*.index.json"))
    return path, model


@pytest.fixture(scope="module")
def odd_llama(tmp_path_factory):
    """6 heads but 3 KV heads: the heads cannot be split over two ranks; a tied head."""
    return _checkpoint(
        tmp_path_factory.mktemp("odd"),
        hidden_size=48,
        num_attention_heads=6,
        num_key_value_heads=3,
        intermediate_size=96,
        num_hidden_layers=2,
        tie_word_embeddings=True,
    )


def _stored_bytes(model_dir: Path, rank: int, layers: range, tied: bool, last: bool) -> int:
    """The bytes of the checkpoint's tensors a pipeline rank should hold, from the files."""
    import mlx.core as mx

    total = 0
    for f in model_dir.glob("*.safetensors"):
        for key, value in mx.load(str(f)).items():
            parts = key.split(".")
            if key.startswith("model.layers."):
                keep = int(parts[2]) in layers
            elif key.startswith("model.embed_tokens."):
                keep = rank == 0 or (tied and last)
            elif key.startswith("lm_head."):
                keep = last
            else:
                keep = True  # the final norm
            total += value.nbytes if keep else 0
    return total


def _hostfile(tmp_path: Path, n: int = 2) -> Path:
    from mlxinfer.distributed.launch import local_hostfile

    return local_hostfile(n, tmp_path)


class Ranks:
    """Two rank processes of ``command``, their output in files; killed on exit."""

    def __init__(self, tmp_path: Path, command: list[str], n: int = 2):
        hostfile = _hostfile(tmp_path, n)
        self.logs = [(tmp_path / f"r{r}.out", tmp_path / f"r{r}.err") for r in range(n)]
        env = {
            **os.environ,
            "MLX_HOSTFILE": str(hostfile),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        self.procs = []
        for r in range(n):
            out, err = (open(p, "w") for p in self.logs[r])
            self.procs.append(
                subprocess.Popen(
                    command,
                    env={**env, "MLX_RANK": str(r)},
                    stdout=out,
                    stderr=err,
                    stdin=subprocess.DEVNULL,
                    cwd=ROOT,
                )
            )

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)

    def wait(self, rank: int, timeout: float = WAIT_S) -> int:
        return self.procs[rank].wait(timeout=timeout)

    def text(self, rank: int, stream: int = 1) -> str:
        return self.logs[rank][stream].read_text()

    def wait_for(self, rank: int, needle: str, timeout: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        while needle not in self.text(rank):
            assert self.procs[rank].poll() is None, self.text(rank)
            assert time.monotonic() < deadline, f"no {needle!r} from rank {rank}"
            time.sleep(0.05)


def _run_rank_script(tmp_path, model_dir, mode):
    out = tmp_path / "out.json"
    command = [sys.executable, str(RANK_SCRIPT), str(model_dir), mode]
    command += [",".join(map(str, PROMPT)), str(N_TOKENS), str(out)]
    with Ranks(tmp_path, command) as ranks:
        codes = [ranks.wait(0), ranks.wait(1)]
        assert codes == [0, 0], ranks.text(0) + ranks.text(1)
        results = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2)]
        assert results[0]["tokens"] == results[1]["tokens"]  # every rank yields the same
        return results, ranks.text(0)


def _reference(model, n=N_TOKENS):
    """transformers' greedy tokens and f32 log-probabilities of each step's choice."""
    import torch
    from hf_models import torch_greedy

    tokens = torch_greedy(model, PROMPT, n)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + tokens[:-1]])).logits[0]
    logprobs = torch.log_softmax(logits, -1).numpy()[len(PROMPT) - 1 :]
    return tokens, logprobs


def _check_parity(result, model):
    tokens, logprobs = _reference(model)
    assert result["tokens"] == tokens
    np.testing.assert_allclose(np.array(result["logprobs"]), logprobs, atol=1e-3)


def test_pipeline_matches_transformers(llama, tmp_path):
    path, model = llama
    results, log = _run_rank_script(tmp_path, path, "pipeline")
    assert "rank 0/2 runs layers 0-1 of 3" in log  # uneven: 2 + 1, no layer dropped
    _check_parity(results[0], model)
    for rank, layers in enumerate((range(0, 2), range(2, 3))):  # only its own tensors
        expected = _stored_bytes(path, rank, layers, tied=False, last=rank == 1)
        assert results[rank]["weight_bytes"] == expected


def test_tensor_matches_transformers(llama, tmp_path):
    path, model = llama
    results, log = _run_rank_script(tmp_path, path, "tensor")
    assert "falls back" not in log and "runs heads 0-1 of 4" in log
    _check_parity(results[0], model)


def test_quantized_shares_add_up_to_the_whole_layer():
    """A quantized gated MLP cut to two ranks' shares (rows of gate and up, columns of down at
    a group boundary, its bias on rank 0 only): the shares' outputs sum to the whole layer's."""
    import copy

    import mlx.core as mx
    import mlx.nn as nn

    from mlxinfer.distributed.experts import split_linears

    mx.random.seed(0)

    def quantized(n_out: int, n_in: int) -> nn.QuantizedLinear:
        return nn.QuantizedLinear.from_linear(nn.Linear(n_in, n_out), group_size=32, bits=4)

    gate, up, down = quantized(128, 64), quantized(128, 64), quantized(64, 128)
    x = mx.random.normal((3, 64))
    whole = down(nn.silu(gate(x)) * up(x))
    total = mx.zeros_like(whole)
    for r in range(2):
        g, u, d = (copy.copy(m) for m in (gate, up, down))
        split_linears([g, u], d, r, 2)
        assert g.weight.shape == (64, 8) and d.scales.shape == (64, 2)  # halves, whole groups
        total = total + d(nn.silu(g(x)) * u(x))
    np.testing.assert_allclose(np.array(total), np.array(whole), atol=1e-5)


def _quantized_tensor_run(tmp_path, source) -> str:
    """``source`` converted to 4 bits (groups of 32) and split by heads over two ranks: one
    process's greedy tokens on the same checkpoint, log-probabilities within 1e-4; the log."""
    import mlxinfer
    from mlxinfer.generation import generate_step
    from mlxinfer.loading.convert import convert

    quantized = tmp_path / "q4"
    convert(source, quantized, quantize=True, bits=4, group_size=32)
    model, _ = mlxinfer.load(quantized)
    steps = list(generate_step(PROMPT, model, max_tokens=N_TOKENS))
    results, log = _run_rank_script(tmp_path, quantized, "tensor")
    assert "falls back" not in log, log
    assert results[0]["tokens"] == [t for t, _ in steps]
    expected = np.array([lp.tolist() for _, lp in steps])
    np.testing.assert_allclose(np.array(results[0]["logprobs"]), expected, atol=1e-4)
    return log


@SLOW_LAUNCH
def test_tensor_splits_a_quantized_checkpoint(llama, tmp_path):
    """Rows of the packed weights, scales and biases, columns at group boundaries."""
    assert "runs heads 0-1 of 4" in _quantized_tensor_run(tmp_path, llama[0])


@SLOW_LAUNCH
def test_tensor_splits_quantized_experts(tmp_path):
    """A tiny mixtral: its quantized experts split by hidden units, its heads by rank."""
    from hf_models import make_tiny
    from tiny_checkpoint import tokenizer_json

    config = dict(vocab_size=300, num_hidden_layers=3, **FAMILIES["mixtral"])
    path, _ = make_tiny(tmp_path / "mixtral", "mixtral", **config)
    (path / "tokenizer.json").write_text(json.dumps(tokenizer_json(300)))
    assert "experts" in _quantized_tensor_run(tmp_path, path)


@SLOW_LAUNCH
def test_tensor_splits_the_experts_of_mixtral(tmp_path):
    """Every rank holds half of each expert's hidden units (and half the heads), the router
    whole: f32 log-probabilities within 1e-4 of transformers, the same greedy tokens."""
    import mlx.core as mx
    from hf_models import make_tiny
    from tiny_checkpoint import tokenizer_json

    path, model = make_tiny(tmp_path / "mixtral", "mixtral", vocab_size=300, **FAMILIES["mixtral"])
    (path / "tokenizer.json").write_text(json.dumps(tokenizer_json(300)))
    results, log = _run_rank_script(tmp_path, path, "tensor")
    assert "falls back" not in log
    line = "rank 0/2 runs heads 0-1 of 4 in every layer and hidden units 0-63 of 128 of each "
    assert line + "layer's 4 experts" in log
    tokens, logprobs = _reference(model)
    assert results[0]["tokens"] == tokens
    np.testing.assert_allclose(np.array(results[0]["logprobs"]), logprobs, atol=1e-4)
    # Each rank holds half of the attention's and the experts' bytes, the rest whole.
    halved = re.compile(r"\.(self_attn\.[qkvo]_proj|block_sparse_moe\.experts|mlp\.experts)\.")
    stored = 0
    for f in path.glob("*.safetensors"):
        for key, value in mx.load(str(f)).items():
            stored += value.nbytes // 2 if halved.search(key) else value.nbytes
    assert [r["weight_bytes"] for r in results] == [stored, stored]


@SLOW_LAUNCH
def test_tensor_falls_back_to_pipeline_when_heads_do_not_divide(odd_llama, tmp_path):
    path, model = odd_llama
    results, log = _run_rank_script(tmp_path, path, "tensor")
    line = "tensor parallelism falls back to the pipeline: 3 KV heads do not divide over 2 ranks"
    assert log.count(line) == 1
    _check_parity(results[0], model)
    # A tied head: the embedding lives on both ends.
    expected = _stored_bytes(path, 1, range(1, 2), tied=True, last=True)
    assert results[1]["weight_bytes"] == expected


def _generate(model_dir, *extra):
    command = [sys.executable, "-m", "mlxinfer", "generate", "-m", str(model_dir)]
    command += ["--distributed", "pipeline", "-p", "Hello world", "--no-chat-template"]
    return command + ["-n", "30000", *extra]


def test_killed_peer_is_a_clear_error(llama, tmp_path):
    with Ranks(tmp_path, _generate(llama[0])) as ranks:
        ranks.wait_for(0, "runs layers")
        time.sleep(0.5)
        assert ranks.procs[0].poll() is None  # still generating
        ranks.procs[1].kill()
        start = time.monotonic()
        assert ranks.wait(0, timeout=30) != 0
        assert time.monotonic() - start < 30
        err = ranks.text(0)
        assert "Error: rank 0: lost rank 1 during pipeline step" in err, err


@SLOW_LAUNCH
def test_stalled_peer_ends_within_the_rank_timeout(llama, tmp_path):
    with Ranks(tmp_path, _generate(llama[0], "--rank-timeout", "3")) as ranks:
        ranks.wait_for(0, "runs layers")
        time.sleep(0.5)
        ranks.procs[1].send_signal(signal.SIGSTOP)
        start = time.monotonic()
        assert ranks.wait(0, timeout=30) == 3
        assert time.monotonic() - start < 15
        err = ranks.text(0)
        assert "did not finish within the rank timeout (3 s, --rank-timeout)" in err, err
        assert "waiting on rank" in err


def _launch(tmp_path, *args, timeout=WAIT_S):
    command = [sys.executable, "-m", "mlxinfer", "launch", *args]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


def test_launcher_fails_with_a_failing_rank_and_ends_the_others(tmp_path):
    pid_file = tmp_path / "rank0.pid"
    script = (
        "import os, sys, time\n"
        f"if os.environ['MLX_RANK'] == '0':\n    open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
        "    time.sleep(60)\n"
        "else:\n    time.sleep(0.5); sys.exit(7)\n"
    )
    start = time.monotonic()
    done = _launch(tmp_path, "-n", "2", "--grace", "2", "--", sys.executable, "-c", script)
    assert done.returncode == 7, done.stderr
    assert time.monotonic() - start < 20
    assert "rank 1 exited with 7" in done.stderr
    with pytest.raises(ProcessLookupError):  # rank 0 was ended with the launcher
        os.kill(int(pid_file.read_text()), 0)


def test_a_wrong_hostfile_or_a_missing_rank_is_a_clear_error(tmp_path):
    hostfile = _hostfile(tmp_path, 3)
    done = _launch(tmp_path, "-n", "2", "--hostfile", str(hostfile), "--", "true")
    assert done.returncode == 1
    assert f"Error: {hostfile}: 3 ranks, but -n 2 (expected one entry per rank)" in done.stderr

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "MLX_HOSTFILE": str(hostfile),
        "MLX_RANK": "5",
    }
    command = [sys.executable, "-m", "mlxinfer", "generate", "--distributed", "pipeline", "-p", "x"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=WAIT_S, env=env)
    assert done.returncode == 1
    assert f"Error: MLX_RANK='5': expected 0..2 (the ranks of {hostfile})" in done.stderr

    # Rank 0 alone of three: joining them is bounded by the rank timeout too.
    command += ["-m", str(tmp_path), "--rank-timeout", "2"]
    start = time.monotonic()
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=WAIT_S, env=env | {"MLX_RANK": "0"}
    )
    assert done.returncode != 0 and time.monotonic() - start < 20
    assert (
        f"Error: rank 0: joining the 3 ranks of {hostfile} (are they all started?) did not finish "
        "within the rank timeout (2 s, --rank-timeout)"
    ) in done.stderr


@SLOW_LAUNCH
def test_launcher_runs_a_sampled_generation_on_two_ranks(llama, tmp_path):
    """At temperature > 0 without --seed, rank 0 draws the seed every rank samples with: the
    ranks stay in step (a rank that sampled another token would stop them all)."""
    path = llama[0]
    command = _generate(path, "--temp", "0.9", "--verbose", "--rank-memory", "1G,3G")
    command[command.index("30000")] = "24"
    done = _launch(tmp_path, "-n", "2", "--", *command)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
    # --rank-memory: layers in proportion to 1:3 (at least one each): 1 + 2, not 2 + 1.
    assert "rank 0/2 runs layers 0-0 of 3" in done.stderr
    # --verbose: each rank's own statistics; the ranks took the same steps (sampling may reach
    # EOS before 24 tokens).
    pattern = (
        r"rank (\d)/2: ([\d.]+) MB of weights, ([\d.]+) (?:bytes|kB|MB) of keys and values "
        r"at most, (\d+) steps, .* waiting"
    )
    stats = [(r, mb, n) for r, mb, kv, n in re.findall(pattern, done.stderr) if float(kv) > 0]
    assert sorted(r for r, _, _ in stats) == ["0", "1"]
    expected = [_stored_bytes(path, 0, range(0, 1), False, False), 0]
    expected[1] = _stored_bytes(path, 1, range(1, 3), False, True)
    assert {r: mb for r, mb, _ in stats} == {
        str(r): f"{b / 1e6:.1f}" for r, b in enumerate(expected)
    }
    assert len({n for _, _, n in stats}) == 1 and int(stats[0][2]) > 2


# Placement, hostfiles and the watchdog, without ranks.


def test_layer_ranges_cover_every_layer_once():
    from mlxinfer.distributed.placement import layer_ranges
    from mlxinfer.errors import DistributedError

    assert layer_ranges(8, 3) == [range(0, 3), range(3, 6), range(6, 8)]
    assert layer_ranges(3, 2) == [range(0, 2), range(2, 3)]
    assert layer_ranges(30, 4) == [range(0, 8), range(8, 16), range(16, 23), range(23, 30)]
    with pytest.raises(DistributedError, match="2 layer\\(s\\) cannot be split over 3 ranks"):
        layer_ranges(2, 3)
    # In proportion to each rank's memory, each rank at least one layer: 64 GB and 128 GB
    # share 30 layers 10 + 20; 1:1:100 leaves the small ranks one each.
    assert layer_ranges(30, 2, [64, 128]) == [range(0, 10), range(10, 30)]
    assert layer_ranges(10, 3, [1, 1, 100]) == [range(0, 1), range(1, 2), range(2, 10)]
    assert layer_ranges(8, 3, [5, 5, 5]) == layer_ranges(8, 3)
    with pytest.raises(DistributedError, match="expected 2 positive shares"):
        layer_ranges(4, 2, [1, 0])


def test_a_pipeline_rank_reads_its_layers_renumbered():
    from tiny_checkpoint import CONFIG

    from mlxinfer.distributed.placement import WeightNames
    from mlxinfer.models import build_model

    model = build_model({**CONFIG, "num_hidden_layers": 4})
    names = WeightNames(model)
    weights = {
        "model.embed_tokens.weight": 0,
        "model.layers.1.mlp.up_proj.weight": 1,
        "model.layers.2.mlp.up_proj.weight": 2,
        "model.layers.12.mlp.up_proj.weight": 12,
        "model.norm.weight": 3,
        "lm_head.weight": 4,
    }
    assert names.for_pipeline(weights, range(2, 4), embedding=False, head=True) == {
        "model.layers.0.mlp.up_proj.weight": 2,
        "model.norm.weight": 3,
        "lm_head.weight": 4,
    }
    assert names.renumber("model.layers.3.mlp", range(2, 4)) == "model.layers.1.mlp"
    assert names.renumber("model.layers.1.mlp", range(2, 4)) is None


def test_which_sizes_split_by_heads():
    from tiny_checkpoint import CONFIG  # 4 heads, 2 KV heads, MLP 64

    from mlxinfer.distributed.placement import tensor_split_reason
    from mlxinfer.models import build_model

    model = build_model(CONFIG)
    assert tensor_split_reason(model, 2) is None
    assert tensor_split_reason(model, 4) == "2 KV heads do not divide over 4 ranks"
    assert tensor_split_reason(model, 3) == "4 attention heads do not divide over 3 ranks"
    # Quantized: each rank's share of o_proj's and down_proj's inputs must be whole groups.
    from mlxinfer.distributed.placement import quantized_split_reason

    inputs = model.layers[0].self_attn.o_proj.weight.shape[-1]
    assert quantized_split_reason(model, {"group_size": inputs // 2}, 2) is None
    reason = quantized_split_reason(model, {"group_size": inputs}, 2)
    assert reason.startswith("layer 0's model.layers.0.self_attn.o_proj: ") and (
        f"{inputs} quantized inputs in groups of {inputs} do not split" in reason
    )
    path = "model.layers.0.self_attn.o_proj"  # a per-layer entry overrides the default
    assert quantized_split_reason(
        model, {"group_size": inputs // 2, path: {"group_size": inputs}}, 2
    )


@pytest.mark.parametrize(
    "text, found",
    [
        ("not json", "unreadable hostfile"),
        ("[]", "expected a JSON list with one entry per rank"),
        ('[["127.0.0.1"]]', "rank 0's entry should be a list of 'host:port' strings"),
        ('[["127.0.0.1:5000"], [7]]', "rank 1's entry should be a list"),
        ('{"hosts": 1}', "expected a JSON list"),
        (" " * (1 << 20) + "[]", "hostfile larger than 1 MB"),
    ],
    ids=["not-json", "empty", "no-port", "not-strings", "not-a-list", "too-large"],
)
def test_a_bad_hostfile_is_a_clear_error(tmp_path, text, found):
    from mlxinfer.distributed import read_hostfile
    from mlxinfer.errors import DistributedError

    path = tmp_path / "hosts.json"
    path.write_text(text)
    with pytest.raises(DistributedError, match=f"^{path}: .*{found[:30]}"):
        read_hostfile(path)


def test_the_watchdog_fires_only_past_its_bound():
    from mlxinfer.distributed import Watchdog

    fired = []
    dog = Watchdog(1, timeout=0.3, on_timeout=fired.append)
    with dog.step("a quick step"):
        time.sleep(0.05)
    time.sleep(0.4)
    assert fired == []
    with dog.step("pipeline step 3 (waiting on rank 0)"):
        time.sleep(0.6)
    assert fired == [
        "rank 1: pipeline step 3 (waiting on rank 0) did not finish within the rank timeout "
        "(0.3 s, --rank-timeout): a rank stalled or is unreachable; exiting"
    ]


# Longer: more families, and the real SmolLM2 (MLXINFER_SLOW=1).

SLOW = pytest.mark.skipif(
    os.environ.get("MLXINFER_SLOW") != "1",
    reason="more two-rank launches than the suite's share: set MLXINFER_SLOW=1 to run",
)
FAMILIES = {
    "qwen2": dict(  # full and sliding layers, split between the ranks; a 4-token window
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=1,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
    ),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),  # tensor: experts split
    "qwen2_moe": dict(  # a shared expert times a whole per-token gate; a dense last layer
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        mlp_only_layers=[2],
    ),
    "glm4_moe": dict(  # DeepSeek-V3's router and added shared experts; a dense first layer
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
    ),
    "phi3": dict(pad_token_id=0, eos_token_id=2),  # fused qkv and gate_up: each part cut
    "gpt_oss": dict(  # attention sinks (split by heads), experts with biases, sliding layers
        num_local_experts=4, num_experts_per_tok=2, head_dim=8, intermediate_size=16
    ),
    "deepseek_v3": dict(  # MLA (tensor: by heads, the latent cache whole on every rank); a
        # dense first layer, then MoE (built by global index)
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=24,
        num_key_value_heads=4,
        moe_intermediate_size=32,
        n_routed_experts=8,
        q_lora_rank=48,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=4,
        topk_group=2,
    ),
}


@SLOW
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_families_match_transformers(tmp_path, family, mode):
    from hf_models import make_tiny
    from tiny_checkpoint import tokenizer_json

    config = dict(vocab_size=300, num_hidden_layers=3, **FAMILIES[family])
    path, model = make_tiny(tmp_path / family, family, **config)
    (path / "tokenizer.json").write_text(json.dumps(tokenizer_json(300)))
    results, log = _run_rank_script(tmp_path, path, mode)
    assert "falls back" not in log  # deepseek_v3's MLA split by heads too (4 over 2 ranks)
    _check_parity(results[0], model)


@SLOW
@pytest.mark.slow
def test_smollm2_falls_back_and_matches_transformers(smollm2_hf_dir, tmp_path):
    """9 heads, 3 KV heads: tensor parallelism falls back to the pipeline on two ranks."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_hf_dir, dtype=torch.float32
    ).eval()
    results, log = _run_rank_script(tmp_path, smollm2_hf_dir, "tensor")
    assert "falls back to the pipeline: 9 attention heads do not divide over 2 ranks" in log
    _check_parity(results[0], model)


@SLOW_LAUNCH
@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_generate_with_a_draft_model_across_ranks_matches_one_process(llama, tmp_path, mode):
    """``generate --distributed --draft-model`` for one prompt: every rank drafts with its own
    whole copy of the draft model (the same inputs and seed: the same drafts, the token check
    holding them to it), greedy and sampled: one process's text."""
    path = llama[0]
    for extra in ([], ["--temp", "0.9", "--seed", "3"]):
        command = _generate(path, "--draft-model", str(path), *extra)
        command[command.index("30000")] = "40"
        alone = [c for c in command if c not in ("--distributed", "pipeline")]
        one = subprocess.run(alone, capture_output=True, text=True, timeout=WAIT_S)
        assert one.returncode == 0 and one.stdout.strip(), one.stderr
        command[command.index("pipeline")] = mode
        done = _launch(tmp_path, "-n", "2", "--", *command)
        assert done.returncode == 0, done.stderr
        assert done.stdout == one.stdout


def _one_rank():
    """A group of one rank (MLX's singleton group: no launch), its waits bounded as two ranks'."""
    import mlx.core as mx

    from mlxinfer.distributed.group import Ranks
    from mlxinfer.distributed.watchdog import Watchdog

    return Ranks(mx.distributed.init(), Watchdog(0, WAIT_S))


def test_a_tensor_rank_self_drafts_each_step_under_the_watchdog(llama):
    """``SelfDraft`` on a tensor rank's model (here one rank: no launch): the rank's own first
    block drafts, each draft forward one evaluation of its own under ``Ranks.run``, and the
    tokens and every step's drafted / accepted counts are one process's with the same draft;
    the same through a pipeline, whose rank 0 drafts (``PipelineModel.first_blocks``), and which
    refuses in one line (the loop's check, before the prefill) a draft deeper than rank 0's
    blocks or without a head on rank 0."""
    from mlxinfer import load, stream_generate
    from mlxinfer.distributed.pipeline import PipelineModel
    from mlxinfer.distributed.tensor import TensorModel
    from mlxinfer.errors import DraftError
    from mlxinfer.generation.drafts import SelfDraft

    model, tok = load(llama[0])
    ranks = _one_rank()
    evaluated = []
    run = ranks.run
    ranks.run = lambda what, arrays, **kw: (evaluated.append(what), run(what, arrays, **kw))

    def steps(m, draft=None):
        # k fixed: a split model chooses k from nominal costs (every rank must draft the same
        # k), one process from its timed steps (generation/draft_length.py), so only a fixed k
        # makes their per-step counts comparable
        fixed = {"num_draft": 2} if draft is not None else {}
        results = list(stream_generate(m, tok, "Hello world", max_tokens=24, draft=draft, **fixed))
        return [r.token for r in results], results[-1].stats

    plain, _ = steps(model)
    alone, alone_stats = steps(model, SelfDraft(1))
    tokens, stats = steps(TensorModel(model, ranks), SelfDraft(1))
    assert tokens == alone == plain
    assert stats.accepted_tokens > 0 and stats.speculative_steps > 1
    assert (stats.draft_tokens, stats.accepted_tokens, stats.speculative_steps) == (
        alone_stats.draft_tokens,
        alone_stats.accepted_tokens,
        alone_stats.speculative_steps,
    )
    drafted = [w for w in evaluated if w.startswith("tensor draft step")]
    assert len(drafted) == stats.draft_tokens  # one evaluation per drafted token
    assert drafted[-1] == f"tensor draft step {stats.draft_tokens} (the first 1 blocks)"

    pipeline = PipelineModel(model, ranks, range(0, 3), 3)
    pipeline.logits_dtype, pipeline.vocab_rows = model.head.weight.dtype, model.head.weight.shape[0]
    pipeline.first_range = range(0, 2)  # rank 0's blocks, as on the first of two ranks
    for n, head, why in [(2, True, "expected 1 to 1 .*fewer than its 2"), (1, False, "no LM head")]:
        pipeline.head_on_first = head
        with pytest.raises(DraftError, match=why):
            SelfDraft(n).check(pipeline, tok)
    pipeline.head_on_first = True
    evaluated.clear()
    tokens, stats = steps(pipeline, SelfDraft(1))
    assert tokens == plain
    assert (stats.draft_tokens, stats.accepted_tokens) == (
        alone_stats.draft_tokens,
        alone_stats.accepted_tokens,
    )
    drafted = [w for w in evaluated if w.startswith("pipeline draft step")]
    assert len(drafted) == 2 * stats.draft_tokens  # its blocks, then its logits shared


@SLOW
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_generate_self_drafting_across_ranks_matches_one_process(llama, odd_llama, tmp_path, mode):
    """``generate --distributed tensor|pipeline --self-draft-layers 1``: under tensor each rank
    drafts with its own first block (its share of the heads, summed over the ranks), over the
    pipeline rank 0 drafts with its first block and its head, its logits shared; greedy and
    seeded: one process's text with the same flag (greedy: and without a draft), and the same
    drafts accepted of the same drafted (the verbose lines of every rank). A model whose heads
    do not divide falls back to the pipeline, where rank 0's one block leaves none to draft
    with: every rank refuses in one line."""
    path = llama[0]
    for extra in ([], ["--temp", "0.9", "--seed", "3"]):
        command = _generate(path, "--self-draft-layers", "1", "--verbose", *extra)
        command[command.index("30000")] = "40"
        command[command.index("pipeline")] = mode
        alone = [c for c in command if c not in ("--distributed", mode)]
        one = subprocess.run(alone, capture_output=True, text=True, timeout=WAIT_S)
        assert one.returncode == 0 and one.stdout.strip(), one.stderr
        if not extra:  # speculative decoding changes no greedy token
            plain = [c for c in alone if c not in ("--self-draft-layers", "1")]
            plain = subprocess.run(plain, capture_output=True, text=True, timeout=WAIT_S)
            assert plain.stdout == one.stdout
        done = _launch(tmp_path, "-n", "2", "--", *command, timeout=2 * WAIT_S)
        assert done.returncode == 0, done.stderr
        assert done.stdout == one.stdout
        [accepted] = re.findall(r"draft accepted +(\d+)/(\d+)", one.stderr)
        assert int(accepted[1]) > 0  # it drafted
        assert re.findall(r"draft accepted +(\d+)/(\d+)", done.stderr) == [accepted] * 2

    if mode == "pipeline":
        return
    command = _generate(odd_llama[0], "--self-draft-layers", "1")
    command[command.index("pipeline")] = "tensor"
    done = _launch(tmp_path, "-n", "2", "--", *command)
    assert done.returncode == 1 and done.stdout == ""
    assert "falls back to the pipeline" in done.stderr and "Traceback" not in done.stderr
    refused = "Error: --self-draft-layers 1 across a pipeline: none allowed (the drafting blocks"
    assert done.stderr.count(refused) == 2, done.stderr


def test_an_interrupted_launcher_ends_its_ranks(tmp_path):
    script = (
        "import os, time\n"
        f"open(os.path.join({str(tmp_path)!r}, 'pid' + os.environ['MLX_RANK']), 'w')"
        ".write(str(os.getpid()))\n"
        "time.sleep(60)\n"
    )
    command = [sys.executable, "-m", "mlxinfer", "launch", "-n", "2", "--grace", "2", "--"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    launcher = subprocess.Popen([*command, sys.executable, "-c", script], env=env)
    try:
        deadline = time.monotonic() + WAIT_S
        while not all((tmp_path / f"pid{r}").is_file() for r in range(2)):
            assert time.monotonic() < deadline and launcher.poll() is None
            time.sleep(0.05)
        time.sleep(0.2)  # the pids written (a file may exist before its text)
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=20) == 130
        for r in range(2):
            with pytest.raises(ProcessLookupError):
                os.kill(int((tmp_path / f"pid{r}").read_text()), 0)
    finally:
        if launcher.poll() is None:
            launcher.kill()
