"""Engine overhead with the model taken out: a stub module returns ready-made logits of the right shape.

The stub satisfies what the engine needs from a transformers model (a config, one parameter for
device and dtype, a module carrying ``layer_idx``) and answers every forward with a slice of a
random logits buffer made once, so the "forward" costs next to nothing and what remains of a step is
the engine's own work: schedule, build inputs, sample, update.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

DEFAULT_LEVELS: tuple[int, ...] = (1, 16, 64, 256)
PHASES: tuple[str, ...] = ("schedule", "build", "forward", "sample", "update")


@dataclass
class _Output:
    logits: torch.Tensor


class _StubLayer(torch.nn.Module):
    """Stands in for a decoder layer: the model runner checks that one carries ``layer_idx``."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = 0


class NullLM(torch.nn.Module):
    """A "causal LM" whose forward returns ``[1, R, V]`` random logits for the ``R`` kept rows."""

    def __init__(
        self,
        config: Any,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        max_rows: int = 256,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.config = config
        self.anchor = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device), requires_grad=False)
        self.layer = _StubLayer(config)
        g = torch.Generator().manual_seed(seed)
        self._dtype, self._seed = dtype, seed
        self.register_buffer(
            "table",
            torch.randn(max_rows, config.vocab_size, generator=g).to(dtype=dtype, device=device),
            persistent=False,
        )

    def forward(self, input_ids: torch.Tensor, logits_to_keep: Any = None, **_: Any) -> _Output:
        """Returns logits for ``logits_to_keep`` rows (an index tensor or a count), or every input row."""
        if isinstance(logits_to_keep, torch.Tensor):
            rows = int(logits_to_keep.numel())
        elif isinstance(logits_to_keep, int) and logits_to_keep > 0:
            rows = logits_to_keep
        else:
            rows = int(input_ids.shape[-1])
        if rows > self.table.shape[0]:
            g = torch.Generator().manual_seed(self._seed)
            self.table = torch.randn(rows, self.config.vocab_size, generator=g).to(self.table)
        return _Output(self.table[:rows].unsqueeze(0))


def null_config(config: Any) -> Any:
    """A copy of ``config`` with one layer: the stub never touches the KV cache, so one layer's worth of
    cache is all the engine needs to allocate."""
    cfg = copy.deepcopy(config.get_text_config() if hasattr(config, "get_text_config") else config)
    cfg.num_hidden_layers = 1
    return cfg


def measure(
    config: Any,
    levels: tuple[int, ...] = DEFAULT_LEVELS,
    steps: int = 50,
    prompt_len: int = 16,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> list[dict[str, Any]]:
    """Per running-request count and sampling mode, median ms per decode step for each phase.

    For each level the engine is filled with that many requests, run until all of them decode, and then
    ``steps`` pure-decode steps are timed from ``engine.last_step.times``.
    """
    from cbgen.llm import LLM
    from cbgen.sampling_params import SamplingParams

    cfg = null_config(config)
    vocab = int(cfg.vocab_size)
    rows = []
    for level in levels:
        for mode, temperature in (("greedy", 0.0), ("sampled", 1.0)):
            model = NullLM(cfg, dtype=dtype, device=device, max_rows=max(level, 1))
            warm_steps = 3
            max_tokens = warm_steps + steps + 4 + -(-level * prompt_len // 2048)
            blocks = level * -(-(prompt_len + max_tokens + 1) // 16) + 16
            # verify_model=False: the stub's logits are random by design, so no check of them could pass.
            llm = LLM(
                model,
                None,
                max_num_seqs=max(level, 1),
                max_num_batched_tokens=2048,
                num_blocks=blocks,
                verify_model=False,
            )
            engine = llm.engine
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True, seed=1)
            for i in range(level):
                prompt = [3 + (i * 31 + j * 7) % (vocab - 3) for j in range(prompt_len)]
                engine.add_request(prompt, params)
            settle = 0
            while settle < warm_steps:
                engine.step()
                last = engine.last_step
                settle = settle + 1 if last.num_decode == level and last.num_prefill_tokens == 0 else 0
            per_phase: dict[str, list[float]] = {p: [] for p in PHASES}
            wall = []
            for _ in range(steps):
                t0 = time.perf_counter()
                engine.step()
                wall.append(time.perf_counter() - t0)
                last = engine.last_step
                if last.num_decode != level:
                    raise RuntimeError(f"null model: expected {level} decodes, got {last.num_decode}")
                for p in PHASES:
                    per_phase[p].append(last.times.get(p, 0.0))
            med = {p: statistics.median(v) * 1e3 for p, v in per_phase.items()}
            overhead = med["schedule"] + med["build"] + med["update"]
            step_ms = statistics.median(wall) * 1e3
            rows.append(
                {
                    "running": level,
                    "mode": mode,
                    "steps": steps,
                    **{f"{p}_ms": med[p] for p in PHASES},
                    "overhead_ms": overhead,
                    "step_ms": step_ms,
                    "tokens_per_s": level / (step_ms / 1e3) if step_ms > 0 else None,
                }
            )
            del llm, engine, model
    return rows
