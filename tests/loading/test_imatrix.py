"""Importance-matrix files (issue 48, item 4): ours round-trips; llama.cpp's GGUF and legacy .dat
imatrix files, laid out as its tools/imatrix/imatrix.cpp writes them, load under our module paths
with the means llama-quantize would use; malformed files are one WeightsError naming the file."""

import json
import struct

import numpy as np
import pytest

from mlxinfer.errors import WeightsError
from mlxinfer.loading.imatrix import Importance, load_importance, save_importance

E, H, F = 4, 8, 6  # experts, hidden (K of q/gate/up), expert intermediate (K of down)
MOE = {"model_type": "qwen3_moe", "num_experts": E, "num_hidden_layers": 2}
RNG = np.random.default_rng(0)


def sq(*shape):
    return (RNG.random(shape) * 4).astype(np.float32)


def importance():
    return Importance(
        sums={
            "model.layers.0.self_attn.q_proj": sq(H),
            "model.layers.0.mlp.experts.down_proj": sq(E, F),
        },
        counts={
            "model.layers.0.self_attn.q_proj": np.array(512, np.int64),
            "model.layers.0.mlp.experts.down_proj": np.array([100, 0, 7, 405], np.int64),
        },
        meta={"model": "tiny", "tokens": "512"},
    )


def test_our_format_round_trips(tmp_path):
    imp = importance()
    save_importance(imp, tmp_path / "imp.safetensors")
    assert [p.name for p in tmp_path.iterdir()] == ["imp.safetensors"]  # no temporary left
    got = load_importance(tmp_path / "imp.safetensors")
    assert got.meta == imp.meta
    for path in imp.sums:
        assert got.sums[path].dtype == np.float32 and got.counts[path].dtype == np.int64
        np.testing.assert_array_equal(got.sums[path], imp.sums[path])
        np.testing.assert_array_equal(got.counts[path], imp.counts[path])
    q = "model.layers.0.self_attn.q_proj"
    np.testing.assert_allclose(got.mean(q), imp.sums[q] / 512, rtol=1e-6)
    down = got.mean("model.layers.0.mlp.experts.down_proj")
    np.testing.assert_array_equal(down[1], np.ones(F, np.float32))  # never routed: ones
    np.testing.assert_allclose(down[3], imp.sums["model.layers.0.mlp.experts.down_proj"][3] / 405)
    assert got.mean("model.layers.9.mlp.up_proj") is None

    both = got.merge(imp)
    np.testing.assert_allclose(both.sums[q], 2 * imp.sums[q])
    assert int(both.counts[q]) == 1024 and both.meta["tokens"] == "1024"
    np.testing.assert_allclose(both.mean(q), got.mean(q), rtol=1e-6)


def gguf_imatrix(path, entries, *, drop=None):
    """A GGUF imatrix as llama.cpp's save_imatrix writes it: general.type, imatrix.* keys, names
    sorted; per entry in_sum2 ggml [K, n_mat], counts ggml [1, n_mat] (F32), in_sum like in_sum2.
    ``entries``: gguf name -> (sums (n_mat, K), counts (n_mat,))."""
    import gguf

    w = gguf.GGUFWriter(path, arch="unused")
    w.kv_data[0].pop("general.architecture")  # llama.cpp's imatrix file has none
    w.add_string("general.type", "imatrix")
    w.add_array("imatrix.datasets", ["calibration.txt"])
    w.add_uint32("imatrix.chunk_count", 3)
    w.add_uint32("imatrix.chunk_size", 512)
    for name in sorted(entries):
        sums, counts = entries[name]
        for suffix, arr in (
            (".in_sum2", sums),
            (".counts", np.asarray(counts, np.float32).reshape(-1, 1)),
            (".in_sum", np.sqrt(sums)),
        ):
            if name + suffix != drop:
                w.add_tensor(name + suffix, np.ascontiguousarray(arr, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def moe_entries():
    return {
        "blk.0.attn_q.weight": (sq(1, H), [512]),
        "blk.0.ffn_gate_inp.weight": (sq(1, H), [512]),
        "blk.0.ffn_down_exps.weight": (sq(E, F), [300, 0, 12, 712]),
        "blk.1.ffn_gate_exps.weight": (gate := sq(E, H), [10, 20, 30, 964]),
        "blk.1.ffn_up_exps.weight": (gate.copy(), [10, 20, 30, 964]),
        "blk.2.attn_q.weight": (sq(1, H), [512]),  # a NextN layer past num_hidden_layers
        "output.weight": (sq(1, H), [512]),
    }


def test_llama_cpp_gguf_imatrix_maps_to_our_paths(tmp_path):
    entries = moe_entries()
    imp = load_importance(gguf_imatrix(tmp_path / "imatrix.gguf", entries), config=MOE)
    assert sorted(imp.sums) == [
        "lm_head",
        "model.layers.0.mlp.experts.down_proj",
        "model.layers.0.mlp.gate",
        "model.layers.0.self_attn.q_proj",
        "model.layers.1.mlp.experts.gate_up_proj",
    ]
    q = imp.mean("model.layers.0.self_attn.q_proj")
    assert q.shape == (H,) and imp.counts["model.layers.0.self_attn.q_proj"].shape == ()
    np.testing.assert_allclose(q, entries["blk.0.attn_q.weight"][0][0] / 512, rtol=1e-6)
    down = imp.mean("model.layers.0.mlp.experts.down_proj")
    sums = entries["blk.0.ffn_down_exps.weight"][0]
    assert down.shape == (E, F)
    np.testing.assert_allclose(down[[0, 2, 3]], sums[[0, 2, 3]] / [[300], [12], [712]], rtol=1e-6)
    np.testing.assert_array_equal(down[1], 1.0)  # expert 1 never routed: ones, as llama-quantize
    gate_up = imp.mean("model.layers.1.mlp.experts.gate_up_proj")
    np.testing.assert_allclose(gate_up[3], entries["blk.1.ffn_gate_exps.weight"][0][3] / 964)
    assert imp.meta["unmapped"] == "1" and imp.meta["unmapped_names"] == "blk.2.attn_q.weight"
    assert json.loads(imp.meta["datasets"]) == ["calibration.txt"]
    assert imp.meta["chunk_size"] == "512" and imp.meta["arch"] == "qwen3moe"

    # Without a config: arch named, every layer kept; a dense arch leaves the experts unmapped.
    dense = load_importance(tmp_path / "imatrix.gguf", arch="llama")
    assert "model.layers.2.self_attn.q_proj" in dense.sums
    assert dense.meta["unmapped"] == "4"  # the router and three expert weights
    with pytest.raises(WeightsError, match="needs the architecture"):
        load_importance(tmp_path / "imatrix.gguf")


def legacy_dat(path, entries, *, tail=True):
    """llama.cpp's save_imatrix_legacy: int32 n, then per entry int32 len, name, int32 ncall,
    int32 nval, nval float32 (sum / count * ncall); then int32 last chunk, int32 len, dataset."""
    out = struct.pack("<i", len(entries))
    for name, (ncall, values) in sorted(entries.items()):
        values = np.asarray(values, "<f4").reshape(-1)
        out += struct.pack("<i", len(name)) + name.encode() + struct.pack("<ii", ncall, values.size)
        out += values.tobytes()
    if tail:
        out += struct.pack("<i", 6) + struct.pack("<i", 9) + b"wiki.test"
    path.write_bytes(out)
    return path


def test_legacy_dat_imatrix_means(tmp_path):
    mean_q, mean_down = sq(H), sq(E, F)
    entries = {
        "blk.0.attn_q.weight": (6, mean_q * 6),
        "blk.0.ffn_down_exps.weight": (6, mean_down * 6),
        "blk.1.attn_k.weight": (0, mean_q),  # ncall 0: values taken as they are
    }
    imp = load_importance(legacy_dat(tmp_path / "imatrix.dat", entries), config=MOE)
    np.testing.assert_allclose(imp.mean("model.layers.0.self_attn.q_proj"), mean_q, rtol=1e-6)
    np.testing.assert_allclose(
        imp.mean("model.layers.0.mlp.experts.down_proj"), mean_down, rtol=1e-6
    )
    np.testing.assert_allclose(imp.mean("model.layers.1.self_attn.k_proj"), mean_q, rtol=1e-6)
    assert imp.counts["model.layers.0.mlp.experts.down_proj"].tolist() == [6] * E
    assert imp.meta["count_unit"] == "chunks" and json.loads(imp.meta["datasets"]) == ["wiki.test"]
    with pytest.raises(WeightsError, match="counted in chunks with ones counted in tokens"):
        imp.merge(importance())
    short = legacy_dat(tmp_path / "old.dat", {"blk.0.attn_q.weight": (2, mean_q)}, tail=False)
    np.testing.assert_allclose(
        load_importance(short, arch="qwen3").mean("model.layers.0.self_attn.q_proj"), mean_q / 2
    )
    with pytest.raises(WeightsError, match=r"blk.0.ffn_down_exps.weight.*needs the model's config"):
        load_importance(tmp_path / "imatrix.dat", arch="qwen3moe")


def raises(path, match, **kw):
    with pytest.raises(WeightsError, match=match) as e:
        load_importance(path, **kw)
    msg = str(e.value)
    assert str(path) in msg and "\n" not in msg
    return msg


def test_hostile_files_are_one_weights_error_naming_the_file(tmp_path):
    ours = tmp_path / "ours.safetensors"
    save_importance(importance(), ours)
    dat = legacy_dat(
        tmp_path / "x.dat", {"blk.0.attn_q.weight": (2, sq(H)), "output.weight": (2, sq(H))}
    )
    gg = gguf_imatrix(tmp_path / "x.gguf", moe_entries())
    for src in (ours, dat, gg):
        data = src.read_bytes()
        for cut in sorted({1, 5, 9, 20, len(data) // 2, len(data) - 3}):
            bad = tmp_path / f"cut{cut}{src.suffix}"
            bad.write_bytes(data[:cut])
            raises(bad, None, config=MOE)

    def dat_bytes(*ints, tail=b""):
        return struct.pack(f"<{len(ints)}i", *ints) + tail

    cases = {
        "entry count 2147483647; expected at least 1 and at most 4": dat_bytes(2**31 - 1, 1)
        + b"x" * 64,
        "entry count -3": dat_bytes(-3) + b"x" * 64,
        "name length -1": dat_bytes(1, -1) + b"x" * 64,
        "nval 1073741823": dat_bytes(1, 1) + b"x" + dat_bytes(1, 2**30 - 1) + b"\0" * 64,
        "ncall -2": dat_bytes(1, 1) + b"x" + dat_bytes(-2, 1) + b"\0" * 4,
        "finite sums of squares >= 0, found nan": dat_bytes(1, 1)
        + b"x"
        + dat_bytes(1, 2)
        + np.array([1, np.nan], "<f4").tobytes(),
        "dataset name length 99": dat_bytes(1, 1) + b"x" + dat_bytes(1, 1, 0, 0, 99),
        "3 bytes after the dataset name": dat_bytes(1, 1)
        + b"x"
        + dat_bytes(1, 1, 0, 0, 0)
        + b"abc",
    }
    for i, (match, data) in enumerate(cases.items()):
        (tmp_path / f"h{i}.dat").write_bytes(data)
        raises(tmp_path / f"h{i}.dat", match, arch="llama")

    e = moe_entries()
    e["blk.0.attn_q.weight"] = (sq(1, H), [512, 3])
    raises(
        gguf_imatrix(tmp_path / "c.gguf", e), r"attn_q.weight.counts: expected 1 counts", config=MOE
    )
    e = moe_entries()
    e["blk.0.ffn_down_exps.weight"][0][2, 1] = np.nan
    raises(
        gguf_imatrix(tmp_path / "n.gguf", e), r"ffn_down_exps.weight: expected finite", config=MOE
    )
    e = moe_entries()
    e["blk.1.ffn_up_exps.weight"][0][0, 0] += 1
    raises(gguf_imatrix(tmp_path / "f.gguf", e), "sums differ", config=MOE)
    raises(
        gguf_imatrix(tmp_path / "d.gguf", moe_entries(), drop="output.weight.counts"),
        "no output.weight.counts",
        config=MOE,
    )
    raises(
        gguf_imatrix(tmp_path / "e.gguf", moe_entries()),
        "4 experts; expected the config.s 8",
        config={**MOE, "num_experts": 8},
    )

    import gguf

    w = gguf.GGUFWriter(tmp_path / "model.gguf", arch="llama")  # a model, not an imatrix
    w.add_tensor("blk.0.attn_q.weight", sq(H, H))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    raises(tmp_path / "model.gguf", "general.type: expected 'imatrix'", arch="llama")

    from safetensors.numpy import save_file

    save_file(
        {"a.in_sum2": sq(E, H), "a.counts": np.zeros(E + 1, np.int64)}, tmp_path / "s.safetensors"
    )
    raises(tmp_path / "s.safetensors", r"a.counts: expected shape \(4,\)")
    save_file({"a.in_sum2": sq(H)}, tmp_path / "t.safetensors")
    raises(tmp_path / "t.safetensors", "a.in_sum2 has no a.counts")
    raises(tmp_path / "missing.dat", "cannot read")
