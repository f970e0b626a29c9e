"""AsyncEngine on a tiny random model: streaming, cancellation, isolation of failures, pause, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time

import pytest
import torch

from cbgen import LLM, SamplingParams
from cbgen.async_engine import AsyncEngine, EngineShutdownError, QueueFullError
from cbgen.core.scheduler import Fairness
from tiny_models import make_model, make_prompts

TIMEOUT = 60.0


class _FailOn:
    """A batch logits processor that raises for rows whose argument is ``"fail"``."""

    name = "fail_on"

    def __call__(self, logits: torch.Tensor, rows, args, requests) -> torch.Tensor:
        if any(a == "fail" for a in args):
            raise RuntimeError("processor exploded on purpose")
        return logits


@pytest.fixture
def llm() -> LLM:
    return LLM(make_model("llama"), block_size=8, num_blocks=64, logits_processors=[_FailOn()])


@pytest.fixture
def engine(llm: LLM):
    ae = AsyncEngine(llm, max_concurrent_requests=8)
    yield ae
    ae.shutdown(abort_inflight=True, timeout=30)
    assert not ae._thread.is_alive()


def run(coro):
    async def bounded():
        return await asyncio.wait_for(coro, TIMEOUT)

    return asyncio.run(bounded())


async def _collect(ae: AsyncEngine, prompt, params, request_id=None):
    outs = [o async for o in ae.generate(prompt, params, request_id)]
    return outs


def _join(outs):
    """Concatenates delta outputs per sample: token ids, logprobs, finish reasons."""
    n = len(outs[0].outputs)
    tokens = [[] for _ in range(n)]
    raw = [[] for _ in range(n)]
    reasons = [None] * n
    for o in outs:
        for c in o.outputs:
            tokens[c.index] += c.token_ids
            raw[c.index] += c.raw_logprobs
            reasons[c.index] = c.finish_reason or reasons[c.index]
    return tokens, raw, reasons


async def _wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def test_concurrent_streams_match_batch_generation(llm, engine):
    prompts = make_prompts(6, lengths=(3, 40))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = llm.generate(prompts, params, use_tqdm=False)

    async def main():
        return await asyncio.gather(*(_collect(engine, p, params) for p in prompts))

    results = run(main())
    for outs, want in zip(results, expected):
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        tokens, raw, reasons = _join(outs)
        assert tokens[0] == want.outputs[0].token_ids
        assert raw[0] == pytest.approx(want.outputs[0].raw_logprobs, abs=1e-4)
        assert reasons == ["length"]
    assert engine.stats().num_used_blocks == 0
    assert engine.stats().in_flight == 0


def test_n_samples_stream_every_sample(engine):
    params = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    outs = run(_collect(engine, [5, 6, 7, 8], params))
    tokens, _, reasons = _join(outs)
    assert [len(t) for t in tokens] == [6, 6, 6]
    assert reasons == ["length"] * 3
    assert outs[-1].finished


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ([], SamplingParams(), "empty"),
        ([5, 512], SamplingParams(), "outside the vocabulary"),
        ([5, "x"], SamplingParams(), "not an integer"),
        ([5, 6], {"max_tokens": 3}, "SamplingParams"),
        ([5, 6], SamplingParams(logprobs=21), "max_logprobs"),
        ("text prompt", SamplingParams(), "tokenizer"),
    ],
)
def test_bad_input_raises_before_queueing(engine, prompt, params, match):
    async def main():
        with pytest.raises(ValueError, match=match):
            await _collect(engine, prompt, params)

    run(main())
    assert not engine._commands and not engine._active


def test_duplicate_request_id_rejected(engine):
    async def main():
        params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
        first = engine.add_request([5, 6, 7], params, request_id="same")
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request([5, 6, 7], params, request_id="same")
        outs = [o async for o in first]
        assert outs[-1].finished
        # Once finished, the id may be reused.
        again = await _collect(engine, [5, 6], SamplingParams(max_tokens=2), request_id="same")
        assert again[-1].finished

    run(main())


def test_closing_the_generator_aborts_and_frees_blocks(engine):
    async def main():
        params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        agen = engine.generate(list(range(3, 40)), params)
        first = await agen.__anext__()
        assert not first.finished
        await agen.aclose()
        await _wait_for(lambda: engine.stats().num_used_blocks == 0 and engine.stats().running == 0)
        assert engine.stats().requests_aborted == 1
        assert engine.stats().in_flight == 0

    run(main())


def test_cancelling_the_consumer_task_aborts(engine):
    async def main():
        params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        started = asyncio.Event()

        async def consume():
            async for _ in engine.generate([5, 6, 7, 8, 9], params):
                started.set()

        task = asyncio.ensure_future(consume())
        await started.wait()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await _wait_for(lambda: engine.stats().num_used_blocks == 0 and not engine.engine.groups)
        # The engine is still serving.
        outs = await _collect(engine, [5, 6], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        assert len(_join(outs)[0][0]) == 3

    run(main())


def test_cancelling_n_samples_frees_every_sample(engine):
    async def main():
        params = SamplingParams(n=3, max_tokens=200, temperature=1.0, ignore_eos=True)
        stream = engine.add_request([5, 6, 7, 8, 9, 10, 11], params)
        await stream.__anext__()
        await stream.__anext__()  # the followers have forked by now
        stream.cancel()
        await _wait_for(lambda: engine.stats().num_used_blocks == 0 and not engine.engine.groups)

    run(main())


def test_cancel_before_the_engine_saw_the_request(engine):
    async def main():
        with engine.pause():
            stream = engine.add_request([5, 6, 7], SamplingParams(max_tokens=5))
            stream.cancel()
        await _wait_for(lambda: not engine._commands)
        await asyncio.sleep(0.05)
        assert not engine.engine.groups
        assert engine.stats().in_flight == 0

    run(main())


def test_abort_by_id_delivers_a_final_abort_output(engine):
    async def main():
        params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        stream = engine.add_request([5, 6, 7], params, request_id="victim")
        outs = [await stream.__anext__()]
        await engine.abort("victim")
        outs += [o async for o in stream]
        assert outs[-1].finished
        assert outs[-1].outputs[0].finish_reason == "abort"
        await _wait_for(lambda: engine.stats().num_used_blocks == 0)

    run(main())


def test_queue_bound_raises_queue_full(engine):
    async def main():
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        with engine.pause():  # keep them all in flight
            streams = [engine.add_request([5, 6, 7 + i], params) for i in range(8)]
            with pytest.raises(QueueFullError):
                engine.add_request([5, 6], params)
            streams[0].cancel()
            replacement = engine.add_request([5, 6], SamplingParams(max_tokens=2))
        for s in streams[1:]:
            s.cancel()
        outs = [o async for o in replacement]
        assert outs[-1].finished

    run(main())


def test_failing_logits_processor_fails_only_its_request(engine):
    async def main():
        good = SamplingParams(
            max_tokens=8, temperature=0, ignore_eos=True, logits_processor_args={"fail_on": "ok"}
        )
        bad = SamplingParams(
            max_tokens=8, temperature=0, ignore_eos=True, logits_processor_args={"fail_on": "fail"}
        )
        plain = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        results = await asyncio.gather(
            _collect(engine, [5, 6, 7], good),
            _collect(engine, [5, 6, 8], bad),
            _collect(engine, [9, 10], plain),
        )
        (g, b, p) = results
        assert b[-1].finished and b[-1].outputs[0].finish_reason == "error"
        assert "exploded" in b[-1].error
        for outs in (g, p):
            tokens, _, reasons = _join(outs)
            assert len(tokens[0]) == 8 and reasons == ["length"]
            assert outs[-1].error is None
        assert engine.stats().num_used_blocks == 0

    run(main())


def test_step_exception_fails_in_flight_and_loop_survives(engine):
    real_step = engine.engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated kernel failure")
        return real_step()

    engine.engine.step = flaky_step

    async def main():
        params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
        results = await asyncio.gather(_collect(engine, [5, 6, 7], params), _collect(engine, [8, 9], params))
        for outs in results:
            assert outs[-1].finished
            assert "simulated kernel failure" in outs[-1].error
            assert outs[-1].outputs[0].finish_reason == "error"
        assert engine.stats().step_errors == 1
        assert engine.stats().num_used_blocks == 0
        outs = await _collect(engine, [5, 6], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        assert outs[-1].error is None and len(_join(outs)[0][0]) == 4

    run(main())


def test_pause_parks_between_steps_and_resumes(llm, engine):
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    expected = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids

    async def main():
        stream = engine.add_request([5, 6, 7], params)
        outs = [await stream.__anext__()]
        async with engine.pause():
            steps = engine.stats().steps
            assert engine.stats().paused
            await asyncio.sleep(0.2)
            assert engine.stats().steps == steps  # parked: no step ran
            assert engine.engine.has_unfinished()  # the request (and its KV) is kept
        outs += [o async for o in stream]
        assert _join(outs)[0][0] == expected

    run(main())


def test_pause_sync_context_from_another_thread(engine):
    parked = threading.Event()

    def holder():
        with engine.pause():
            parked.set()
            time.sleep(0.1)

    async def main():
        params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
        t = threading.Thread(target=holder)
        t.start()
        outs = await _collect(engine, [5, 6, 7], params)
        t.join()
        assert parked.is_set()
        assert len(_join(outs)[0][0]) == 20

    run(main())


def test_shutdown_aborts_inflight_and_rejects_new(engine):
    async def main():
        params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        stream = engine.add_request([5, 6, 7], params)
        await stream.__anext__()
        engine.start_shutdown(abort_inflight=True)
        rest = [o async for o in stream]
        assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
        with pytest.raises(EngineShutdownError):
            engine.add_request([5, 6], params)

    run(main())
    engine.shutdown(timeout=10)
    assert not engine._thread.is_alive()
    assert engine.engine.block_manager.num_used_blocks == 0


def test_shutdown_without_abort_finishes_inflight(engine):
    async def main():
        params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
        stream = engine.add_request([5, 6, 7], params)
        engine.start_shutdown(abort_inflight=False)
        outs = [o async for o in stream]
        assert outs[-1].outputs[0].finish_reason == "length"
        assert len(_join(outs)[0][0]) == 20

    run(main())


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux /proc")
def test_idle_engine_thread_does_not_spin(engine):
    def stat() -> list[str]:
        with open(f"/proc/self/task/{engine._thread.native_id}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()

    def cpu_ticks() -> int:
        fields = stat()
        return int(fields[11]) + int(fields[12])  # utime + stime

    run(_collect(engine, [5, 6], SamplingParams(max_tokens=2)))
    # Wait (polling, with a deadline) until the thread has gone to sleep after its last request: on a
    # loaded machine its wind-down may still be running when the outputs arrive.
    deadline = time.monotonic() + 60
    while stat()[0] != "S":
        assert time.monotonic() < deadline, f"engine thread never slept: state {stat()[0]}"
        time.sleep(0.01)
    before = cpu_ticks()
    time.sleep(0.5)  # the window measured, not a wait for a condition
    # CPU time, not wall time: a sleeping thread accrues none however loaded the machine is, while a
    # polling one accrues ticks (usually 10 ms each) in proportion to the window.
    assert cpu_ticks() - before <= 2


def test_from_llm_and_wrong_type(llm):
    ae = AsyncEngine.from_llm(llm)
    try:
        assert ae.engine is llm.engine
    finally:
        ae.shutdown()
    with pytest.raises(TypeError):
        AsyncEngine(object())


# ---------------------------------------------------------------------------------------------- admission by work
def test_work_budget_counts_sequences_times_tokens_and_frees_on_end(llm):
    ae = AsyncEngine(llm, max_inflight_work=100)
    try:

        async def main():
            wide = SamplingParams(n=4, max_tokens=17, temperature=1.0, ignore_eos=True)  # 4 x (3 + 17) = 80
            with ae.pause():
                first = ae.add_request([5, 6, 7], wide)
                assert ae.stats().inflight_work == 80
                with pytest.raises(QueueFullError, match="token slots"):
                    ae.add_request([5, 6, 7], SamplingParams(max_tokens=18))  # 80 + 21 > 100
                with pytest.raises(ValueError, match="101 token slots"):  # could never fit
                    ae.add_request([5, 6, 7], SamplingParams(n=1, max_tokens=98))
                small = ae.add_request([5, 6], SamplingParams(max_tokens=18))  # 80 + 20 fits
            assert (await _drain(first))[-1].finished and (await _drain(small))[-1].finished
            assert ae.stats().inflight_work == 0 and ae.admission.requests == 0
            cancelled = ae.add_request([5, 6, 7], wide)
            cancelled.cancel()
            assert ae.stats().inflight_work == 0

        run(main())
    finally:
        ae.shutdown(timeout=30)


async def _drain(stream):
    return [o async for o in stream]


def test_one_client_holds_at_most_its_share(llm):
    ae = AsyncEngine(llm, max_concurrent_requests=4, max_inflight_work=1000, client_share=0.5)
    try:

        async def main():
            params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
            with ae.pause():
                mine = [ae.add_request([5, 6], params, client="a") for _ in range(2)]
                with pytest.raises(QueueFullError, match="one client"):
                    ae.add_request([5, 6], params, client="a")  # 2 of 4 requests: its share
                theirs = ae.add_request([5, 6], params, client="b")
                with pytest.raises(ValueError, match="in-flight limit of 500 for one client"):
                    ae.add_request([5], SamplingParams(max_tokens=500), client="b")
            for s in [*mine, theirs]:
                assert (await _drain(s))[-1].finished
            assert ae.admission.held_by("a") == (0, 0)

        run(main())
    finally:
        ae.shutdown(timeout=30)


# ---------------------------------------------------------------------------------------------- backpressure
def test_stream_whose_reader_stops_is_paused_and_loses_nothing(llm):
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    expected = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
    ae = AsyncEngine(llm, stream_buffer=4)
    try:

        async def main():
            stream = ae.add_request([5, 6, 7], params)
            await _wait_for(lambda: ae.stats().streams_paused == 1)
            steps = ae.stats().steps
            await asyncio.sleep(0.3)
            # Preempted and parked: nothing more is computed, buffered or held.
            assert ae.stats().steps == steps and ae.stats().num_used_blocks == 0
            assert stream.buffered <= 4 + 2  # the bound, plus outputs of steps already under way
            outs = await _drain(stream)
            tokens, _, reasons = _join(outs)
            assert tokens[0] == expected and reasons == ["length"]
            assert ae.stats().streams_paused == 0 and ae.stats().preemptions >= 1

        run(main())
    finally:
        ae.shutdown(timeout=30)


def test_shutdown_lets_a_paused_stream_finish(llm):
    ae = AsyncEngine(llm, stream_buffer=2)

    async def main():
        stream = ae.add_request([5, 6], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        await _wait_for(lambda: ae.stats().streams_paused == 1)
        ae.start_shutdown(abort_inflight=False)
        tokens, _, reasons = _join(await _drain(stream))
        assert len(tokens[0]) == 12 and reasons == ["length"]

    run(main())
    ae.shutdown(timeout=30)
    assert not ae._thread.is_alive()


@pytest.mark.parametrize("fair", [True, False])
def test_fair_engine_serves_a_small_request_while_a_big_one_runs(fair):
    # The big job takes every seat: first come, first served admits the small request only once one
    # of the big sequences has ended, 200 tokens in.  (Nobody reads the big streams: unbounded
    # buffers keep backpressure from freeing seats in its stead.)
    llm = LLM(make_model("llama"), block_size=8, num_blocks=64, max_num_seqs=16)
    ae = AsyncEngine(llm, stream_buffer=None, fairness=Fairness(quantum=16) if fair else None)
    big_params = SamplingParams(n=4, max_tokens=200, ignore_eos=True)

    async def main():
        big = [ae.add_request([5 + i, 6, 7], big_params, job="big") for i in range(4)]
        await _wait_for(lambda: ae.stats().generated_tokens > 40)
        small = await _drain(ae.add_request([9, 9], SamplingParams(max_tokens=4, ignore_eos=True)))
        assert small[-1].outputs[0].finish_reason == "length"
        ended_before = ae.stats().requests_finished - 1
        for s in big:
            s.cancel()
        await _wait_for(lambda: ae.stats().num_used_blocks == 0)
        return ended_before

    try:
        ended_before = run(main())
    finally:
        ae.shutdown(timeout=30)
    assert (ended_before == 0) if fair else (ended_before >= 1)


# ---------------------------------------------------------------------------------------------- the engine facade
def test_engine_control_pauses_reports_and_knows_when_there_is_work(llm):
    engine = llm.engine
    control = engine.control
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    a, b = engine.add_request([5, 6, 7], params), engine.add_request([8, 9], params)
    snap = control.snapshot()
    assert (snap.running, snap.waiting, snap.paused, snap.num_used_blocks) == (0, 2, 0, 0)
    assert snap.num_free_blocks == snap.num_blocks == 64
    control.pause(a)
    control.pause(b)
    assert control.snapshot().paused == 2 and not control.has_runnable_work()
    engine.step()  # nothing runs while both are paused
    assert control.snapshot().waiting == 2 and engine.stats.generated_tokens == 0
    control.resume(a)
    assert control.has_runnable_work()
    engine.step()
    snap = control.snapshot()
    assert (snap.running, snap.waiting, snap.paused) == (1, 1, 1)
    assert snap.num_used_blocks == 1 and snap.num_free_blocks == 63 and snap.kv_usage == pytest.approx(1 / 64)
    control.resume_all()
    assert control.snapshot().paused == 0
    while engine.has_unfinished():
        engine.step()
    assert not control.has_runnable_work() and control.snapshot().num_used_blocks == 0
    control.fairness = Fairness(quantum=8)
    assert control.fairness.quantum == 8


def test_front_ends_reach_the_engine_only_through_its_facade():
    """AsyncEngine and the server never touch the scheduler, the block manager, the step in flight
    or the lockstep of an engine (``engine.control`` and ``engine.request_limits`` are theirs)."""
    import ast
    from pathlib import Path

    import cbgen

    root = Path(cbgen.__file__).parent
    private = {"scheduler", "block_manager", "in_flight", "sync", "lockstep"}
    found = []
    for path in [root / "async_engine.py", *sorted((root / "server").glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Attribute) and node.attr in private):
                continue
            owner = node.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if name in ("engine", "core"):
                found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    assert found == []
