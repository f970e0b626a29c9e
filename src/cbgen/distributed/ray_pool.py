"""A fleet of engines as Ray actors, for rollout and batch jobs outside a trainer (extra ``ray``).

One actor per engine (per GPU, or per share of the CPUs), each holding an :class:`cbgen.LLM`.
:meth:`EnginePool.generate` cuts the prompts into chunks and keeps every live actor busy with at most
two chunks at a time, handing the next chunk to whichever actor finishes first (least-loaded
dispatch).  An actor that dies fails only the chunks it held: their outputs come back with
``finish_reason == "error"`` and the reason, the actor is dropped, and the rest go on.

Input is checked as ``LLM.generate`` checks it, with its exceptions and messages, before any chunk
is handed out: the number of ``SamplingParams`` here, the prompts and params by one actor's engine
(the checks need its vocabulary, limits and tokenizer).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Any

from cbgen.distributed.dp import RankFailure, check_inputs
from cbgen.llm import LLM
from cbgen.outputs import CompletionOutput, RequestOutput


class _EngineActor:
    """The body of one actor: an LLM built inside the actor's process."""

    def __init__(self, model: Any, llm_kwargs: dict) -> None:
        from cbgen import LLM

        self.llm = LLM(model, **llm_kwargs)

    def generate(self, prompts: list, params: Any) -> list[RequestOutput]:
        return self.llm.generate(prompts, params, use_tqdm=False)

    def check(self, prompts: list, params: Any) -> RankFailure | None:
        """What ``LLM.generate`` would raise on this input before running anything, as data (a Ray
        task error would wrap the message in a remote traceback)."""
        try:
            check_inputs(self.llm, prompts, params)
        except Exception as exc:
            return RankFailure.of(0, exc)
        return None

    def ping(self) -> bool:
        return True


class EnginePool:
    """``num_engines`` engines as Ray actors; ``llm_kwargs`` are :class:`cbgen.LLM` arguments.

    ``model`` is a folder, a ``.gguf`` file or None (the default model): each actor loads it
    itself.  ``num_cpus`` / ``num_gpus`` are each actor's Ray resources.  Ray is started
    (``ray.init(**ray_init)``) unless it already runs.
    """

    def __init__(
        self,
        num_engines: int,
        model: str | None = None,
        *,
        num_cpus: float = 1,
        num_gpus: float = 0,
        chunk_size: int | None = None,
        ray_init: dict | None = None,
        **llm_kwargs: Any,
    ) -> None:
        import ray

        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        if not ray.is_initialized():
            ray.init(**(ray_init or {}))
        self._ray = ray
        remote = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(_EngineActor)
        self.actors = [remote.remote(model, llm_kwargs) for _ in range(num_engines)]
        self.chunk_size = chunk_size
        ray.get([a.ping.remote() for a in self.actors])  # fail here, not at the first request

    @property
    def num_alive(self) -> int:
        """Actors still serving."""
        return len(self.actors)

    def generate(self, prompts: Sequence[Any], params: Any = None) -> list[RequestOutput]:
        """Outputs for ``prompts`` (token-id lists or strings), in input order.  ``params`` is one
        ``SamplingParams`` or one per prompt."""
        if not self.actors:
            raise RuntimeError("every engine of the pool has died")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt, as LLM.generate takes it
        prompts = list(prompts)
        per_prompt = LLM._params_list(params, len(prompts))  # its ValueError, before Ray is involved
        self._check(prompts, per_prompt)
        size = self.chunk_size or max(1, math.ceil(len(prompts) / (4 * len(self.actors))))
        chunks = deque(list(range(i, min(i + size, len(prompts)))) for i in range(0, len(prompts), size))
        results: list[RequestOutput | None] = [None] * len(prompts)
        running: dict[Any, tuple[Any, list[int]]] = {}

        def dispatch(actor: Any) -> None:
            if chunks:
                idx = chunks.popleft()
                chunk_params = [per_prompt[i] for i in idx]
                running[actor.generate.remote([prompts[i] for i in idx], chunk_params)] = (actor, idx)

        for actor in list(self.actors):
            dispatch(actor)
            dispatch(actor)
        while running:
            (ref,), _ = self._ray.wait(list(running), num_returns=1)
            actor, idx = running.pop(ref)
            try:
                outputs = self._ray.get(ref)
            except self._ray.exceptions.RayActorError as exc:
                self._drop(actor)
                for i in idx:
                    results[i] = _failed(i, prompts[i], per_prompt[i].n, f"engine actor died: {exc}")
                continue
            for i, out in zip(idx, outputs):
                results[i] = out
            if actor in self.actors:
                dispatch(actor)
            if not any(a in self.actors for a, _ in running.values()) and chunks and self.actors:
                dispatch(self.actors[0])
        for i, out in enumerate(results):  # chunks no live actor could take
            if out is None:
                results[i] = _failed(i, prompts[i], per_prompt[i].n, "every engine of the pool has died")
        return results

    def _check(self, prompts: list, per_prompt: list) -> None:
        """Raises what ``LLM.generate`` would raise on this input (its type and message), checked by
        the first live actor's engine."""
        while self.actors:
            actor = self.actors[0]
            try:
                failure = self._ray.get(actor.check.remote(prompts, per_prompt))
            except self._ray.exceptions.RayActorError:
                self._drop(actor)
                continue
            if failure is not None:
                raise failure.exception(failure.message, "the engine actor")
            return
        raise RuntimeError("every engine of the pool has died")

    def _drop(self, actor: Any) -> None:
        if actor in self.actors:
            self.actors.remove(actor)

    def shutdown(self) -> None:
        """Kills the actors (Ray itself keeps running)."""
        for actor in self.actors:
            self._ray.kill(actor)
        self.actors = []


def _failed(index: int, prompt: Any, n: int, reason: str) -> RequestOutput:
    return RequestOutput(
        request_id=f"pool-{index}",
        prompt=prompt if isinstance(prompt, str) else None,
        prompt_token_ids=list(prompt) if not isinstance(prompt, str) else [],
        outputs=[CompletionOutput(index=k, finish_reason="error") for k in range(n)],
        finished=True,
        error=reason,
    )
