"""AsyncEngine: streaming while others run, abort frees blocks, stats; the shared engine's tests run with async
scheduling off (the default) and on (what a GPU run needs to verify it: docs/gpu.md)."""

from __future__ import annotations

import asyncio

import pytest

from engine import AsyncEngine, SamplingParams
from tests.helpers import PROMPTS

TINY_KV = 32 << 20  # the tiny model's KV cache: far more tokens than its context, a small part of the default


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async_scheduling"])
def engine(tiny_llama_path, request):
    eng = AsyncEngine(model=str(tiny_llama_path), log_stats=False, kv_cache_bytes=TINY_KV,
                      async_scheduling=request.param)
    yield eng
    eng.shutdown()


def _params(n):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


async def _collect(engine, request_id, prompt, n):
    outs = [out async for out in engine.generate(request_id, prompt, _params(n))]
    return outs


def test_streams_run_concurrently_and_finish_in_length_order(engine):
    async def main():
        finished = []

        async def run(rid, n):
            outs = await _collect(engine, rid, PROMPTS[0], n)
            finished.append(rid)
            return outs

        results = await asyncio.gather(run("long", 100), run("short-a", 10), run("short-b", 10))
        return finished, results

    finished, (long, short_a, _) = asyncio.run(main())
    assert finished[-1] == "long"
    assert len(long) == 100 and all(len(o.new_token_ids) == 1 for o in long)
    assert long[-1].finished and long[-1].finish_reason == "length"
    assert "".join(o.delta_text for o in long) == long[-1].text
    assert engine.stats().kv_blocks_used == 0


def test_a_slow_consumer_gets_every_ready_token_in_one_chunk(engine):
    async def main():
        chunks = []
        async for chunk in engine.generate_chunks("chunked", PROMPTS[3], _params(40)):
            chunks.append(chunk)
            await asyncio.sleep(0.05)  # slower than the tiny model's steps: tokens pile up
        return chunks

    chunks = asyncio.run(main())
    outs = [out for chunk in chunks if chunk for out in chunk]
    expected = asyncio.run(_collect(engine, "unchunked", PROMPTS[3], 40))
    assert [o.new_token_ids for o in outs] == [o.new_token_ids for o in expected]
    assert "".join(o.delta_text for o in outs) == expected[-1].text
    assert len(chunks) < len(outs) / 2 and chunks[-1][-1].finished
    assert engine.stats().kv_blocks_used == 0


def test_abort_frees_blocks_and_closing_stream_aborts(engine):
    async def main():
        stream = engine.generate("to-abort", PROMPTS[1], _params(None))  # None: until the context fills
        await stream.__anext__()
        assert engine.stats().running == 1 and engine.stats().kv_blocks_used > 0
        assert 0 < engine.stats().kv_utilisation < 1
        await engine.abort("to-abort")
        assert engine.stats().kv_blocks_used == 0
        await stream.aclose()

        stream = engine.generate("to-close", PROMPTS[2], _params(None))  # None: until the context fills
        await stream.__anext__()
        await stream.aclose()  # a client that goes away
        for _ in range(100):
            if engine.stats().kv_blocks_used == 0:
                break
            await asyncio.sleep(0.01)
        stats = engine.stats()
        assert stats.kv_blocks_used == 0 and stats.running == 0 and stats.waiting == 0

    asyncio.run(main())


def test_bad_request_fails_alone(engine):
    async def main():
        with pytest.raises(ValueError):
            await _collect(engine, "bad", [], 4)
        outs = await _collect(engine, "good", PROMPTS[3], 4)
        assert outs[-1].finished and len(outs[-1].token_ids) == 4

    asyncio.run(main())


def test_full_waiting_queue_refuses_new_requests_with_retry_hint(tiny_llama_path):
    from engine import EngineOverloadedError

    tight = AsyncEngine(model=str(tiny_llama_path), log_stats=False, kv_cache_bytes=TINY_KV, max_num_seqs=1,
                        max_waiting_requests=1)

    async def main():
        async def run(rid):
            try:
                return len(await _collect(tight, rid, PROMPTS[0], 50))
            except EngineOverloadedError as exc:
                return exc

        return await asyncio.gather(*(run(f"r{i}") for i in range(4)))

    try:
        results = asyncio.run(main())
        refused = [r for r in results if isinstance(r, EngineOverloadedError)]
        assert refused and all(r.retry_after_s > 0 and "overloaded" in str(r) for r in refused)
        assert [r for r in results if r == 50]  # the admitted ones ran to the end
        assert asyncio.run(_collect(tight, "after", PROMPTS[1], 5))[-1].finished  # and it keeps serving
    finally:
        tight.shutdown()


def test_a_step_that_raises_fails_every_request_at_once(tiny_llama_path):
    """A step that raises ends the loop: the stream waiting on it and every later request get EngineDeadError at
    once (none waits forever), and the engine reports itself unhealthy, which fails its replica's health check.
    The fault here is the sampler taken from under a running request (on any device: a CUDA decode graph would
    still find a KV cache taken away)."""
    from engine import EngineDeadError

    eng = AsyncEngine(model=str(tiny_llama_path), log_stats=False, kv_cache_bytes=TINY_KV)

    async def main():
        stream = eng.generate("running", PROMPTS[0], _params(50))
        await stream.__anext__()
        eng.engine.sampler = None
        with pytest.raises(EngineDeadError, match="engine loop died"):
            await asyncio.wait_for(_drain(stream), 30)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(_collect(eng, "later", PROMPTS[1], 2), 30)

    try:
        assert eng.is_healthy
        asyncio.run(main())
        assert not eng.is_healthy
    finally:
        eng.shutdown()


async def _drain(stream) -> None:
    async for _ in stream:
        pass


def test_a_more_urgent_request_overtakes_the_waiting_ones(tiny_llama_path):
    """vLLM's priority: with one sequence running at a time, a request of priority -1 that arrives last is served
    before the earlier ones of priority 0, which keep their order."""
    one = AsyncEngine(model=str(tiny_llama_path), log_stats=False, kv_cache_bytes=TINY_KV, max_num_seqs=1)

    async def main():
        finished = []
        running = asyncio.Event()

        async def run(rid, priority, tokens):
            params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, priority=priority)
            async for out in one.generate(rid, PROMPTS[0], params):
                running.set()
                if out.finished:
                    finished.append(rid)

        tasks = [asyncio.create_task(run("first", 0, 300))]
        await running.wait()  # the first runs: the others queue behind it, in this order
        for rid, priority in (("second", 0), ("third", 0), ("urgent", -1)):
            tasks.append(asyncio.create_task(run(rid, priority, 8)))
            await asyncio.sleep(0.005)
        await asyncio.gather(*tasks)
        return finished

    try:
        assert asyncio.run(main()) == ["first", "urgent", "second", "third"]
    finally:
        one.shutdown()
