"""TRL's ``GRPOTrainer`` generating with cbgen: ``GRPOTrainer(..., rollout_func=cbgen_rollout_func())``.

TRL 1.16's experimental ``rollout_func(prompts, trainer)`` hook replaces the trainer's generation
step.  The function built here keeps one warm :class:`~cbgen.LLM` per trainer, on the very module
being trained (``trainer.accelerator.unwrap_model(trainer.model)``: no copy, no weight sync, LoRA
adapters used as they are; cbgen notices each optimizer step itself).  Per call it:

* groups the prompts, which TRL hands over repeated once per generation, into one request of
  ``n = num_generations`` samples each, so each prompt is computed once;
* tokenises them the way TRL's own generation path does (chat template with the trainer's tools and
  ``chat_template_kwargs`` for conversational prompts, the plain tokenizer otherwise), so
  ``prompt_ids`` are the ones TRL would have produced;
* samples with the trainer's settings (``temperature``, ``top_p``, ``top_k``, ``min_p``,
  ``repetition_penalty``, ``max_completion_length``, the trainer's EOS ids, and ``generation_kwargs``
  where cbgen has an equivalent; a key it cannot honour is an error, never silently dropped);
* returns ``prompt_ids``, ``completion_ids`` and ``logprobs``: the log-probability of each token
  under the distribution it was sampled from (cbgen's processed logprobs).  Without top-k/top-p/min-p
  and penalties that is ``log_softmax(logits / temperature)``, what TRL recomputes as its "old"
  logprobs (equal to ~1e-6 in fp32; see docs/trl.md for bf16 and truncation).

With ``parity=True`` (:class:`TrainerParity`) the engine runs in parity mode
(``batch_invariant=True``) and the trainer's per-token logprobs are computed by cbgen's trainer side:
the model's forward inside ``cbgen.parity`` and the same log-softmax function the engine uses, in
place of TRL's fused LM head.  A rollout's logprobs then equal TRL's logprobs of the same tokens
under the same weights bit for bit: the importance ratio on fresh rollouts is exactly 1.

See docs/trl.md.  Nothing here imports TRL: the trainer is read through its attributes.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cbgen.batch_invariant import context as parity_context
from cbgen.batch_invariant.logprobs import truncated_logprobs
from cbgen.llm import LLM
from cbgen.sampling_params import SamplingParams

logger = logging.getLogger("cbgen")

TESTED_TRL = "1.16.0"

# generation_kwargs keys with no effect on which tokens are drawn (cbgen has its own cache and pads nothing).
_IGNORED_KWARGS = frozenset(
    {
        "cache_implementation",
        "disable_compile",
        "pad_token_id",
        "bos_token_id",
        "use_cache",
        "do_sample",
        "return_dict_in_generate",
    }
)


@dataclass
class RolloutRecord:
    """What one call of the rollout function did (kept on the function, for logs and tests)."""

    num_prompts: int
    num_groups: int
    n: int
    weight_version: int
    generated_tokens: int
    seconds: float


@dataclass
class CbgenRollout:
    """The ``rollout_func`` callable; build it with :func:`cbgen_rollout_func`."""

    llm_kwargs: dict[str, Any] = field(default_factory=dict)
    release_memory: bool = False
    logprobs: str = "processed"
    sampling_overrides: dict[str, Any] = field(default_factory=dict)
    extra_fields: bool = False
    parity: bool = False
    records: list[RolloutRecord] = field(default_factory=list)
    # parity=True: per trainer logprob call that scored tokens of the latest rollout under the
    # weights it was generated with, the largest |exp(trainer - rollout) - 1| over those tokens.
    parity_ratios: list[float] = field(default_factory=list)
    _llms: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary, repr=False)
    _latest: dict = field(default_factory=dict, repr=False)  # parity: the latest rollout's logprobs

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list]:
        """TRL's hook: completions (and their logprobs) for ``prompts``, in order."""
        import time

        start = time.perf_counter()
        llm = self.llm_for(trainer)
        n = _group_size(trainer)
        groups = _groups(prompts, n)
        prompt_ids = _tokenize(trainer, [prompts[i] for i, _ in groups])
        params = self.sampling_params(trainer, n=n)
        if self.release_memory and not llm.engine.kv_cache.allocated:
            llm.resume_memory()
        try:
            outputs = llm.generate([list(p) for p in prompt_ids], params, use_tqdm=False)
        finally:
            if self.release_memory:
                llm.release_memory()  # the optimizer step that follows gets the KV cache's memory
        result: dict[str, list] = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        extras: dict[str, list] = {"raw_logprobs": [], "log_kept_mass": [], "weight_version": []}
        for (_, size), ids, out in zip(groups, prompt_ids, outputs):
            if out.error:
                raise RuntimeError(f"cbgen failed a rollout request: {out.error}")
            for sample in out.outputs[:size]:
                result["prompt_ids"].append(list(ids))
                result["completion_ids"].append(list(sample.token_ids))
                lp = sample.token_logprobs if self.logprobs == "processed" else sample.raw_logprobs
                result["logprobs"].append(list(lp))
                extras["raw_logprobs"].append(list(sample.raw_logprobs))
                extras["log_kept_mass"].append(list(sample.log_kept_mass))
                extras["weight_version"].append(out.weight_version)
        if self.extra_fields:
            result.update({f"cbgen_{k}": v for k, v in extras.items()})
        if self.parity:
            self._latest = {
                "weights": llm.engine.weights.fingerprint(),
                "logprobs": {
                    (tuple(p), tuple(c)): lp
                    for p, c, lp in zip(result["prompt_ids"], result["completion_ids"], result["logprobs"])
                },
            }
        self.records.append(
            RolloutRecord(
                num_prompts=len(prompts),
                num_groups=len(groups),
                n=n,
                weight_version=llm.weight_version,
                generated_tokens=sum(len(c) for c in result["completion_ids"]),
                seconds=time.perf_counter() - start,
            )
        )
        return result

    def llm_for(self, trainer: Any) -> LLM:
        """The trainer's warm engine, built on first use around the module being trained."""
        llm = self._llms.get(trainer)
        if llm is None:
            _check_trainer(trainer)
            model = trainer.accelerator.unwrap_model(trainer.model)
            kwargs = dict(self.llm_kwargs)
            if self.parity:
                _check_parity_settings(self.sampling_params(trainer, n=1))
                kwargs["batch_invariant"] = True
            llm = LLM(model, trainer.processing_class, **kwargs)
            self._llms[trainer] = llm
            if self.parity:
                TrainerParity(self, trainer, llm).install()
        return llm

    def sampling_params(self, trainer: Any, n: int) -> SamplingParams:
        """The trainer's generation settings as cbgen ``SamplingParams`` (see the module docstring)."""
        kw: dict[str, Any] = {
            "n": n,
            "max_tokens": trainer.max_completion_length,
            "temperature": trainer.temperature,
            "top_p": trainer.top_p if trainer.top_p is not None else 1.0,
            "top_k": trainer.top_k if trainer.top_k else -1,
            "min_p": trainer.min_p or 0.0,
            "repetition_penalty": trainer.repetition_penalty,
            "stop_token_ids": [t for t in trainer.eos_token_ids if t is not None],
        }
        kw.update(_from_generation_kwargs(getattr(trainer.args, "generation_kwargs", None) or {}))
        kw.update(self.sampling_overrides)
        return SamplingParams(**kw)


class TrainerParity:
    """The trainer's per-token logprobs the way the engine computes them (``parity=True``).

    It replaces, on this trainer instance only, GRPOTrainer's ``_get_per_token_logps_and_entropies``
    (TRL's fused LM head, which scores tokens in its own tiles and order) with: the model's forward
    inside ``cbgen.parity`` (outside autocast: the engine runs the module as it is stored), then
    ``log_softmax(logits / temperature)`` at each completion token through
    :func:`cbgen.batch_invariant.logprobs.truncated_logprobs`, the function the engine's sampler
    gives its processed logprobs with.  Gradients flow as through TRL's own path; gradient
    checkpointing works inside ``cbgen.parity`` (its recomputation replays the parity forward)."""

    def __init__(self, rollout: CbgenRollout, trainer: Any, llm: LLM) -> None:
        self.rollout, self.trainer, self.llm = rollout, weakref.proxy(trainer), llm

    def install(self) -> None:
        """Puts :meth:`per_token_logps` in place of the trainer's method (on the instance)."""
        self.trainer._get_per_token_logps_and_entropies = self.per_token_logps

    def per_token_logps(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None = None,
        compute_entropy: bool = False,
        compute_aux_loss: bool = False,
        **multimodal: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """GRPOTrainer's contract: logprobs ``[B, logits_to_keep]`` of the completion tokens, their
        entropies (optional) and the MoE auxiliary loss (optional)."""
        if any(v is not None for v in multimodal.values()):
            raise ValueError("cbgen's TRL parity path scores text models only")
        unwrapped = self.trainer.accelerator.unwrap_model(model)
        batch_size = batch_size or input_ids.shape[0]
        temperature = float(self.trainer.temperature)
        logps, entropies, aux = [], [], []
        for start in range(0, input_ids.shape[0], batch_size):
            ids = input_ids[start : start + batch_size]
            mask = attention_mask[start : start + batch_size]
            kwargs: dict[str, Any] = {"output_router_logits": True} if compute_aux_loss else {}
            with torch.autocast(ids.device.type, enabled=False), parity_context.parity(unwrapped):
                out = model(input_ids=ids, attention_mask=mask, use_cache=False, **kwargs)
            logits = out.logits[:, -logits_to_keep - 1 : -1]
            tokens = ids[:, -logits_to_keep:]
            rows = logits.reshape(-1, logits.shape[-1])
            n = rows.shape[0]
            lp = truncated_logprobs(
                rows,
                tokens.reshape(-1),
                torch.full((n,), temperature, device=rows.device),
                torch.full((n,), float("-inf"), device=rows.device),
            ).view(tokens.shape)
            logps.append(lp)
            if compute_entropy:
                with torch.no_grad():
                    scaled = torch.log_softmax(logits.float() / temperature, dim=-1)
                    entropies.append(-(scaled.exp() * scaled).sum(-1))
            if compute_aux_loss:
                aux.append(out.aux_loss)
        result = torch.cat(logps)
        self._compare(input_ids, attention_mask, logits_to_keep, result)
        return (
            result,
            torch.cat(entropies) if compute_entropy else None,
            torch.stack(aux).mean() if compute_aux_loss else None,
        )

    def _compare(self, input_ids: torch.Tensor, mask: torch.Tensor, keep: int, logps: torch.Tensor) -> None:
        """Records the largest |ratio - 1| against the latest rollout's logprobs, for the rows that
        are its sequences, while the weights are still the ones it was generated with."""
        latest = self.rollout._latest
        if not latest or self.llm.engine.weights.fingerprint() != latest["weights"]:
            return
        worst, found = 0.0, False
        for row in range(input_ids.shape[0]):
            real = mask[row].bool()
            prompt = input_ids[row, :-keep][real[:-keep]].tolist()
            completion = input_ids[row, -keep:][real[-keep:]].tolist()
            old = latest["logprobs"].get((tuple(prompt), tuple(completion)))
            if old is None or not completion:
                continue
            found = True
            new = logps[row, -keep:][real[-keep:]].detach().float().cpu()
            ratio = torch.exp(new - torch.tensor(old, dtype=torch.float32))
            worst = max(worst, float((ratio - 1).abs().max()))
        if found:
            self.rollout.parity_ratios.append(worst)


def _check_parity_settings(params: SamplingParams) -> None:
    """TRL's loss scores tokens under ``log_softmax(logits / temperature)``; the rollout's logprobs
    equal that only when nothing else shaped the distribution the tokens were drawn from."""
    shaped = []
    if params.top_k not in (-1, 0) or params.top_p < 1.0 or params.min_p > 0.0:
        shaped.append("truncation (top_k, top_p, min_p)")
    if params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty:
        shaped.append("penalties")
    if params.logit_bias or params.logits_processor_args or params.structured_output is not None:
        shaped.append("logit bias, logits processors or structured output")
    if params.temperature == 0.0:
        shaped.append("greedy decoding")
    if shaped:
        raise ValueError(
            "cbgen_rollout_func(parity=True): TRL scores tokens under the full distribution at its temperature, "
            f"and these settings change the distribution they are drawn from: {', '.join(shaped)}"
        )


def cbgen_rollout_func(
    *,
    release_memory: bool = False,
    logprobs: str = "processed",
    sampling_overrides: dict[str, Any] | None = None,
    extra_fields: bool = False,
    parity: bool = False,
    **llm_kwargs: Any,
) -> CbgenRollout:
    """A ``rollout_func`` for TRL's ``GRPOTrainer`` that generates with cbgen.

    ``release_memory`` frees the KV cache after each rollout and allocates it again before the next
    one, so the backward pass and the optimizer step have that memory (costs a re-allocation per
    rollout).  ``logprobs``: ``"processed"`` (the default, the sampling distribution) or ``"raw"``
    (``log_softmax`` of the raw logits at temperature 1).  ``sampling_overrides`` are extra
    :class:`~cbgen.SamplingParams` fields (e.g. ``{"structured_output": {"json": schema}}``) applied
    after the trainer's settings.  ``extra_fields`` adds ``cbgen_raw_logprobs``,
    ``cbgen_log_kept_mass`` and ``cbgen_weight_version`` to the output, which TRL forwards to the
    reward functions.  ``parity``: the engine in parity mode and TRL's per-token logprobs computed
    the engine's way (:class:`TrainerParity`): rollout logprobs equal TRL's bit for bit, and
    ``parity_ratios`` records the largest |ratio - 1| of each check.  Other keyword arguments go to
    :class:`~cbgen.LLM` (``max_num_seqs``, ``kv_cache_memory``, ...).
    """
    if logprobs not in ("processed", "raw"):
        raise ValueError(f"logprobs must be 'processed' or 'raw', got {logprobs!r}")
    if parity and logprobs != "processed":
        raise ValueError(
            "parity=True compares TRL's logprobs with the processed ones: use logprobs='processed'"
        )
    fn = CbgenRollout(
        llm_kwargs=dict(llm_kwargs),
        release_memory=release_memory,
        logprobs=logprobs,
        sampling_overrides=dict(sampling_overrides or {}),
        extra_fields=extra_fields,
        parity=parity,
    )
    SamplingParams(**fn.sampling_overrides)  # a bad override fails here, not at the first step
    return fn


def _check_trainer(trainer: Any) -> None:
    import trl

    if trl.__version__ != TESTED_TRL:
        logger.warning(
            "cbgen's TRL rollout was tested with trl==%s, this is %s; the rollout_func hook is experimental "
            "and may have changed (pip install 'cbgen[trl]' pins the tested version)",
            TESTED_TRL,
            trl.__version__,
        )
    if getattr(trainer, "use_vllm", False):
        raise ValueError("rollout_func with use_vllm=True would run vLLM too: set use_vllm=False")
    if getattr(trainer, "tools", None) or getattr(trainer, "environment_factories", None):
        # TRL runs the turns after a tool call through its own generation path, not the hook.
        logger.warning("with tools, TRL generates the turns after a tool call itself, without cbgen")
    if getattr(trainer, "_tokenizer", None) is not trainer.processing_class:
        raise ValueError("cbgen's TRL rollout supports text models (a tokenizer as processing_class) only")


def _group_size(trainer: Any) -> int:
    training = trainer.model.training
    return trainer.num_generations if training else trainer.num_generations_eval


def _groups(prompts: Sequence[Any], n: int) -> list[tuple[int, int]]:
    """``(index of the first prompt, size)`` per run of equal consecutive prompts, each run of size
    ``n`` (TRL repeats each prompt ``num_generations`` times in a row)."""
    if not prompts:
        return []
    runs: list[tuple[int, int]] = []
    for i, prompt in enumerate(prompts):
        if runs and prompt == prompts[runs[-1][0]] and runs[-1][1] < n:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    if any(size != n for _, size in runs):
        raise ValueError(
            f"expected each prompt repeated num_generations={n} times in a row (TRL {TESTED_TRL}'s order), got "
            f"runs of {sorted({size for _, size in runs})}; this TRL version hands prompts over differently"
        )
    return runs


def _tokenize(trainer: Any, prompts: list[Any]) -> list[list[int]]:
    """Prompt token ids, as TRL's own generation path makes them."""
    tok = trainer.processing_class
    if prompts and isinstance(prompts[0], list):  # conversational: a list of messages
        ids = tok.apply_chat_template(
            conversation=prompts,
            tools=getattr(trainer, "tools", None) or None,
            chat_template=getattr(trainer, "chat_template", None),
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            **(getattr(trainer, "chat_template_kwargs", None) or {}),
        )["input_ids"]
    else:
        ids = tok(text=prompts)["input_ids"]
    return [list(map(int, p)) for p in ids]


_KWARG_MAP: dict[str, Callable[[Any], dict[str, Any]]] = {
    "max_new_tokens": lambda v: {"max_tokens": v},
    "min_new_tokens": lambda v: {"min_tokens": v},
    "temperature": lambda v: {"temperature": v},
    "top_p": lambda v: {"top_p": v if v is not None else 1.0},
    "top_k": lambda v: {"top_k": v if v else -1},
    "min_p": lambda v: {"min_p": v or 0.0},
    "repetition_penalty": lambda v: {"repetition_penalty": v},
    "eos_token_id": lambda v: {"stop_token_ids": [v] if isinstance(v, int) else list(v)},
    "suppress_tokens": lambda v: {"logit_bias": {int(t): float("-inf") for t in v}},
    "bad_words_ids": lambda v: {"logits_processor_args": {"bad_words": [list(w) for w in v]}},
    "seed": lambda v: {"seed": v},
    "presence_penalty": lambda v: {"presence_penalty": v},
    "frequency_penalty": lambda v: {"frequency_penalty": v},
}


def _from_generation_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``GRPOConfig.generation_kwargs`` as SamplingParams fields; refuses what cbgen cannot honour."""
    out: dict[str, Any] = {}
    unknown = []
    for key, value in kwargs.items():
        if key in _IGNORED_KWARGS:
            if key == "do_sample" and value is False:
                out["temperature"] = 0.0
            continue
        convert = _KWARG_MAP.get(key)
        if convert is None:
            unknown.append(key)
        else:
            out.update(convert(value))
    if unknown:
        raise ValueError(
            f"generation_kwargs {sorted(unknown)} have no cbgen equivalent; supported: "
            f"{sorted(_KWARG_MAP)} (ignored as irrelevant: {sorted(_IGNORED_KWARGS)})"
        )
    return out


__all__ = ["TESTED_TRL", "CbgenRollout", "RolloutRecord", "TrainerParity", "cbgen_rollout_func"]
