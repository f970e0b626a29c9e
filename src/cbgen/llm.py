"""``LLM``: the synchronous API for batch jobs and in-process RL rollouts."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from cbgen.config import EngineConfig
from cbgen.engine import Engine, StepStats
from cbgen.inputs import as_token_ids
from cbgen.outputs import RequestOutput
from cbgen.sampling_params import SamplingParams
from cbgen.utils import _libc

logger = logging.getLogger("cbgen")

# A string, token ids, or vLLM's prompt dicts: {"prompt": text} or {"prompt_token_ids": ids}.
PromptType = str | Sequence[int] | Mapping[str, Any]
_PROMPT_KEYS = ("prompt", "prompt_token_ids")


def _file_into(finished: dict[str, RequestOutput]) -> Callable[[RequestOutput], None]:
    """The engine's ``on_abort`` hook: files an aborted request's final output into ``finished``
    (an LLM's outputs owed to :meth:`LLM.drive_until_empty`), by request id."""

    def file(out: RequestOutput) -> None:
        finished[out.request_id] = out

    return file


def return_free_memory() -> None:
    """Hands the C allocator's free pages back to the OS (glibc's ``malloc_trim(0)``; elsewhere
    nothing).  Only free memory is returned: it costs the time to release those pages (0.2 ms after
    a tiny LLM, 50-100 ms after SmolLM2's ~0.9 GB) and later allocations fault pages in again."""
    with contextlib.suppress(OSError, AttributeError):  # no glibc: nothing to ask
        _libc().malloc_trim(0)


class LLM:
    """A continuous-batching generator over a transformers causal LM.

    ``model`` is an ``nn.Module`` (used as it is, shared with a trainer if you like: no copy, no
    conversion), a local Hugging Face folder, a ``.gguf`` file, or None for the embedded default
    model (SmolLM2-135M-Instruct).  Remaining keyword arguments are :class:`EngineConfig` fields.

    Tensor parallelism: pass a model transformers sharded (``tp_plan="auto"``, or its
    tensor-parallel API on a module in memory), or a folder with ``tensor_parallel_size=N`` under
    ``torchrun``; every rank builds its ``LLM`` and calls it the same way (or only rank 0 adds
    requests and the others run ``llm.engine.follow()``).  See docs/distributed.md.

    Trainer parity: ``batch_invariant=True`` makes every token's ``raw_logprobs`` equal, bit for
    bit, ``cbgen.token_logprobs`` of the module's forward inside ``cbgen.parity(model)``, whatever
    the batch, chunking or cache state (slower; see docs/rl.md, "Trainer parity").
    """

    def __init__(
        self,
        model: torch.nn.Module | str | None = None,
        tokenizer: Any = None,
        *,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device | None = None,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 256,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        enable_prefix_caching: bool = True,
        logits_processors: Sequence = (),
        tensor_parallel_size: int = 1,
        **engine_kwargs: Any,
    ) -> None:
        if isinstance(model, torch.nn.Module):
            self.model = model
            self.tokenizer = tokenizer
        else:
            from cbgen.model.loading.loader import load_model

            self.model, loaded_tokenizer = load_model(
                model,
                dtype=dtype,
                device=device,
                tokenizer=tokenizer,
                tensor_parallel_size=tensor_parallel_size,
            )
            self.tokenizer = tokenizer or loaded_tokenizer
        self.config = EngineConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            block_size=block_size,
            num_blocks=num_blocks,
            kv_cache_memory=kv_cache_memory,
            enable_prefix_caching=enable_prefix_caching,
            device=str(device) if device is not None else None,
            dtype=str(dtype),
            **engine_kwargs,
        )
        self.engine = Engine(self.model, self.tokenizer, self.config, logits_processors)
        self._finished: dict[str, RequestOutput] = {}
        # The engine files aborted outputs straight into that dict: a hook bound to this LLM would
        # make LLM and engine a reference cycle, which frees neither (nor the KV cache) until the
        # cycle collector runs.
        self.engine.on_abort = _file_into(self._finished)
        self._paused = False

    def __del__(self, _finalizing=sys.is_finalizing) -> None:
        # glibc keeps freed heap memory for reuse (blocks under its mmap threshold, up to 32 MB, are
        # not unmapped): after `del llm` no tensor was alive but a process with SmolLM2 stayed
        # ~0.9 GB above its size before the LLM, until malloc_trim gave back all but ~60 MB.
        # What this LLM holds (engine, KV cache, a model it loaded) is dropped first: its attributes
        # would otherwise be freed only after this method returns, too late for the trim.
        # (The check is bound at definition: at interpreter exit module globals such as ``sys`` may
        # already be None when this runs.)
        if _finalizing():  # the process is ending: the OS takes it all back
            return
        with contextlib.suppress(Exception):  # a finalizer must not raise
            self.__dict__.clear()
            return_free_memory()

    # ------------------------------------------------------------------ prompts
    def _encode(self, prompt: PromptType) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("string prompts need a tokenizer; pass token ids or LLM(model, tokenizer)")
            return self.tokenizer.encode(prompt, add_special_tokens=True), prompt
        if isinstance(prompt, Mapping):
            unknown = sorted(str(k) for k in prompt if k not in _PROMPT_KEYS)
            if unknown:
                raise ValueError(
                    f"prompt dict keys {unknown} are not supported (only 'prompt' or 'prompt_token_ids')"
                )
            if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
                raise ValueError("a prompt dict needs exactly one of 'prompt' and 'prompt_token_ids'")
            if "prompt" in prompt:
                if not isinstance(prompt["prompt"], str):
                    raise ValueError(f"'prompt' must be a string, got {type(prompt['prompt']).__name__}")
                return self._encode(prompt["prompt"])
            return as_token_ids(prompt["prompt_token_ids"]), None
        return as_token_ids(prompt), None

    @staticmethod
    def _params_list(sampling_params, count: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        params = list(sampling_params)
        if len(params) != count:
            raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
        return params

    # ------------------------------------------------------------------ batch API
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generates for every prompt; returns outputs in input order.

        Prompts are strings (tokenised as they are; the chat template is not applied, see
        :meth:`chat`), token-id lists, or vLLM's prompt dicts (``{"prompt": text}``,
        ``{"prompt_token_ids": ids}``).  Invalid input raises ``ValueError`` before anything runs.
        """
        if isinstance(prompts, (str, Mapping)) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        encoded = [self._encode(p) for p in prompts]
        params = self._params_list(sampling_params, len(encoded))
        for (ids, _), p in zip(encoded, params):
            self.engine.validate(ids, p)
        ids_out = [self.engine.add_request(ids, p, prompt=text) for (ids, text), p in zip(encoded, params)]
        results = self._run(set(ids_out), use_tqdm=use_tqdm)
        return [results[i] for i in ids_out]

    def chat(
        self,
        messages: list[dict[str, str]] | Sequence[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Applies the tokenizer's chat template to each conversation, then generates."""
        if self.tokenizer is None:
            raise ValueError("chat() needs a tokenizer with a chat template")
        if messages and isinstance(messages[0], dict):
            messages = [messages]  # one conversation
        prompts = [
            self.tokenizer.apply_chat_template(
                conv,
                tokenize=True,
                add_generation_prompt=add_generation_prompt,
                return_dict=False,
                **(chat_template_kwargs or {}),
            )
            for conv in messages
        ]
        return self.generate([list(p) for p in prompts], sampling_params, use_tqdm=use_tqdm)

    # ------------------------------------------------------------------ RL driver
    def add_requests(
        self,
        prompts: Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[str]:
        """Queues token-id prompts without running them; returns their request ids."""
        params = self._params_list(sampling_params, len(prompts))
        encoded = [self._encode(p) for p in prompts]
        for (ids, _), p in zip(encoded, params):
            self.engine.validate(ids, p)
        return [self.engine.add_request(ids, p, prompt=text) for (ids, text), p in zip(encoded, params)]

    def drive_until_empty(
        self, on_step: Callable[[int, StepStats], None] | None = None, use_tqdm: bool = False
    ) -> dict[str, RequestOutput]:
        """Runs steps until no request is left; returns every output finished since the last call,
        by request id.  Requests ended with ``llm.engine.abort(id)`` (before this call or from
        ``on_step``) are among them, with the tokens they had and ``finish_reason == "abort"``: the
        output ``abort`` returned."""
        self._run(None, on_step=on_step, use_tqdm=use_tqdm)
        done = dict(self._finished)
        self._finished.clear()
        return done

    def _run(
        self,
        wanted: set[str] | None,
        on_step: Callable[[int, StepStats], None] | None = None,
        use_tqdm: bool = False,
    ) -> dict[str, RequestOutput]:
        if self._paused:
            raise RuntimeError("the engine is paused: leave the LLM.pause() block before generating")
        engine = self.engine
        bar = None
        if use_tqdm:
            total = len(wanted) if wanted is not None else engine.num_unfinished
            bar = tqdm(total=total, desc="cbgen", unit="req", dynamic_ncols=True)
        generated_at_start = engine.stats.generated_tokens
        try:
            while engine.has_unfinished() and (wanted is None or not wanted <= self._finished.keys()):
                outputs = engine.step()
                if on_step is not None:
                    on_step(engine.stats.steps, engine.last_step)
                for out in outputs:
                    if out.finished:
                        self._finished[out.request_id] = out
                        if bar is not None and (wanted is None or out.request_id in wanted):
                            bar.update(1)
                if bar is not None:
                    elapsed = bar.format_dict.get("elapsed") or 0.0
                    if elapsed > 0:
                        rate = (engine.stats.generated_tokens - generated_at_start) / elapsed
                        bar.set_postfix_str(f"{rate:.0f} tok/s", refresh=False)
        finally:
            if bar is not None:
                bar.close()
        if wanted is None:
            return dict(self._finished)
        return {rid: self._finished.pop(rid) for rid in wanted}

    # ------------------------------------------------------------------ RL helpers
    @property
    def stats(self):
        """Cumulative engine counters (:class:`cbgen.core.stats.EngineStats`)."""
        return self.engine.stats

    @property
    def weight_version(self) -> int:
        """How many weight changes the engine has observed."""
        return self.engine.weights.version

    def notify_weights_updated(self) -> None:
        """Declares a weight change that cannot be detected automatically (writes through
        ``param.data``): the next step drops the prefix cache and applies the in-flight policy."""
        self.engine.weights.force_change()

    def reset_prefix_cache(self) -> None:
        """Forgets all cached prefixes (not needed after weight updates: those are detected)."""
        self.engine.reset_prefix_cache()

    def release_memory(self) -> None:
        """Frees the KV cache (and graph pools) so a trainer can use the memory."""
        self.engine.release_memory()

    def resume_memory(self) -> None:
        """Re-allocates what :meth:`release_memory` freed."""
        self.engine.resume_memory()

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Parks the engine between steps so the caller can run a training step.

        In-flight requests and the KV cache are kept; generation continues with the next
        ``drive_until_empty``/``generate`` call.  Stepping the engine inside the block raises.  On exit
        the weights are checked at once, so a change made inside is handled by the documented policy
        (prefix cache dropped, in-flight requests recomputed under the new weights).
        """
        self._paused = True
        try:
            yield
        finally:
            self._paused = False
            for out in self.engine.check_weights():
                if out.finished:
                    self._finished[out.request_id] = out
