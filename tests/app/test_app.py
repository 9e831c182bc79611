"""The app API (mlxinfer/handle.py): the model handle, cancellation from another thread, the async
stream, progress, residency, the memory guard and the thread-safety contract."""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import mlx.core as mx
import pytest
from hf_models import add_tokenizer, make_tiny

from mlxinfer import ModelHandle, astream_generate, generate, load
from mlxinfer.errors import WeightsError


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path, _ = make_tiny(tmp_path_factory.mktemp("app"), vocab_size=320, hidden_size=64)
    add_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def handle(tiny_dir):
    with ModelHandle(str(tiny_dir)) as h:
        yield h


def _settle() -> int:
    gc.collect()
    mx.clear_cache()
    return mx.get_active_memory()


def test_a_handle_generates_what_generate_does(handle, tiny_dir):
    model, tokenizer = load(str(tiny_dir))
    assert handle.generate("Hello", max_tokens=12) == generate(
        model, tokenizer, "Hello", max_tokens=12
    )


def test_two_async_streams_interleave_while_the_loop_keeps_ticking(handle):
    """Both streams make progress turn by turn, and an unrelated task ticking every 10 ms is
    never held up by more than 100 ms."""

    async def main():
        ticks, order = [], []

        async def ticker():
            while True:
                ticks.append(time.perf_counter())
                await asyncio.sleep(0.01)

        async def one(i):
            async for _ in astream_generate(handle, f"Tell me about {i}", max_tokens=40):
                order.append(i)
            return order.count(i)

        task = asyncio.create_task(ticker())
        counts = await asyncio.gather(one(0), one(1))
        task.cancel()
        return ticks, order, counts

    ticks, order, counts = asyncio.run(main())
    assert counts == [40, 40]
    switches = sum(a != b for a, b in zip(order, order[1:]))
    assert switches >= 20, "".join(map(str, order))  # interleaved, not one after the other
    assert max(b - a for a, b in zip(ticks, ticks[1:])) < 0.1


def test_a_bare_model_streams_async_too(tiny_dir):
    model, tokenizer = load(str(tiny_dir))

    async def main():
        return "".join(
            [r.text async for r in astream_generate(model, tokenizer, "Hi", max_tokens=8)]
        )

    assert asyncio.run(main()) == generate(model, tokenizer, "Hi", max_tokens=8)


def test_leaving_an_async_stream_early_cancels_it(handle):
    async def main():
        n = 0
        async for _ in handle.astream("Go on", max_tokens=500):
            n += 1
            if n == 3:
                break
        await asyncio.sleep(0)
        return n

    assert asyncio.run(main()) == 3
    deadline = time.monotonic() + 5
    while handle.engine.stats().blocks_in_use:
        assert time.monotonic() < deadline, "the request's blocks were not freed"
        time.sleep(0.01)


# MLX's active memory wobbles by a few kB between identical requests (small arrays such as a
# request's token history are allocated and freed at different moments); a leak of what a
# request holds (its KV blocks: 64 kB a block here, its logits) is far above this.
WOBBLE = 16 * 1024


def test_cancelling_from_another_thread_frees_the_blocks_and_the_memory(handle):
    handle.generate("Warm up", max_tokens=4)
    blocks, active = handle.engine.stats().blocks_in_use, _settle()
    stream = handle.start("Write a long story", max_tokens=1000)
    n, held = 0, 0
    for _ in stream:
        n += 1
        held = max(held, handle.engine.stats().blocks_in_use)
        if n == 3:
            threading.Thread(target=stream.cancel).start()
    assert held > blocks  # the request held blocks
    assert n <= 3 + 2  # it ended within a couple of steps of the cancel
    assert handle.engine.stats().blocks_in_use == blocks
    del stream
    assert abs(_settle() - active) < WOBBLE


def test_load_and_convert_report_monotone_progress_to_the_total(tiny_dir, tmp_path):
    from mlxinfer import convert

    events = []
    with ModelHandle(str(tiny_dir), progress=lambda *e: events.append(e)) as h:
        h.load()
    assert events[0][1] == 0 and events[-1][1] == events[-1][2] > 0
    assert all(b[1] >= a[1] for a, b in zip(events, events[1:]))

    events = []
    convert(tiny_dir, tmp_path / "out", quantize=True, bits=4, progress=lambda *e: events.append(e))
    stages = {}
    for stage, done, total in events:
        assert done >= stages.get(stage, (0, 0))[0] and done <= total
        stages[stage] = (done, total)
    assert set(stages) == {"reading weights", "writing weights"}
    assert all(done == total > 0 for done, total in stages.values())


def test_unload_and_the_keep_alive_give_the_memory_back(tiny_dir):
    before = _settle()
    h = ModelHandle(str(tiny_dir))
    h.generate("Hi", max_tokens=4)
    assert h.loaded and _settle() > before + h.memory()["weights"] // 2
    h.unload()
    assert not h.loaded and abs(_settle() - before) < WOBBLE

    with ModelHandle(str(tiny_dir), keep_alive=0.3) as idle:
        idle.generate("Hi", max_tokens=4)
        assert idle.loaded
        deadline = time.monotonic() + 10
        while idle.loaded:
            assert time.monotonic() < deadline, "the keep-alive did not unload the model"
            time.sleep(0.05)
        assert abs(_settle() - before) < WOBBLE
        assert idle.generate("Hi", max_tokens=4)  # loaded again on use


def test_memory_figures(handle):
    handle.load()
    m = handle.memory()
    assert m["weights"] > 0 and m["active"] >= m["weights"] and m["peak"] >= m["active"]
    assert set(m) == {"weights", "kv_in_use", "kv_pool", "active", "peak", "cache"}


def test_several_threads_share_one_handle(handle, tiny_dir):
    """The contract: any number of threads at once; each gets what it would alone."""
    model, tokenizer = load(str(tiny_dir))
    prompts = [f"Thread {i} says" for i in range(6)]
    expected = [generate(model, tokenizer, p, max_tokens=16) for p in prompts]
    got = [None] * 6

    def run(i):
        got[i] = handle.generate(prompts[i], max_tokens=16)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == expected


def test_a_model_larger_than_the_working_set_is_refused_unless_forced(tiny_dir, monkeypatch):
    from mlxinfer.loading import memory

    monkeypatch.setattr(memory, "recommended_working_set", lambda: 1000)
    with pytest.raises(WeightsError, match="recommended working set is 0.0 GB") as e:
        load(str(tiny_dir))
    assert str(tiny_dir) in str(e.value) and "force=True" in str(e.value)
    model, _ = load(str(tiny_dir), force=True)
    assert model is not None


def test_options_the_engine_does_not_take_are_named(handle):
    with pytest.raises(TypeError, match="max_kv_size"):
        handle.start("Hi", max_kv_size=64)
