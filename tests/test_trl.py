"""TRL's GRPOTrainer generating through cbgen (``cbgen.integrations.trl``), with and without LoRA.

A tiny Llama and the tiny tokenizer (nothing downloaded), 3 optimizer steps, ``bf16=False``.  TRL is
made to recompute its "old" logprobs (``steps_per_generation=2`` > ``gradient_accumulation_steps``),
and those must equal the logprobs cbgen returned, token for token, to :data:`ULPS` float32 ulps of
the logprob (the README's claim).  Both sides compute the same float32 forward, summing in other
orders (cbgen's paged C attention, TRL's SDPA; log-softmax in each), so they differ in the last bits
only: at most 3 ulps measured (1.4e-6 at these logprobs, -4 to -8).
"""

from __future__ import annotations

import math

import pytest
import torch

from extras import require_extra

trl = require_extra("trl")
datasets = require_extra("datasets")

from cbgen.integrations.trl import _from_generation_kwargs, _groups, cbgen_rollout_func  # noqa: E402
from tiny_models import make_model, make_state_model  # noqa: E402
from tiny_tokenizer import make_tokenizer  # noqa: E402

N = 4
ULPS = 8


def _ulps_apart(old: torch.Tensor, ours: torch.Tensor) -> torch.Tensor:
    """``|old - ours|`` in float32 ulps of ``max(|old|, 1)`` (near 0 a logprob still carries the
    rounding of logits of order 1)."""
    scale = old.abs().clamp_min(1.0)
    ulp = torch.pow(2.0, torch.floor(torch.log2(scale)) - 23)
    return (old - ours).abs() / ulp


def _reward_digits(completions, **kwargs):
    """Fraction of characters that are digits: learnable, and varied enough to give advantages."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


def _trainer(tmp_path, rollout, peft_config=None, model=None, **config):
    model = make_model("llama") if model is None else model
    tok = make_tokenizer()
    tok.padding_side = "left"
    prompts = ["The weather in Paris", "Count to ten", "What is the answer", "Name a city", "yes or no"]
    dataset = datasets.Dataset.from_dict({"prompt": prompts * 4})
    args = trl.GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        steps_per_generation=2,  # generation batch 8 = 2 prompts x 4, reused over 2 optimizer steps
        num_generations=N,
        max_completion_length=12,
        max_steps=3,
        learning_rate=1e-3,
        bf16=False,
        use_cpu=True,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        temperature=0.9,
        seed=0,
        **config,
    )
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=_reward_digits,
        args=args,
        train_dataset=dataset,
        processing_class=tok,
        rollout_func=rollout,
        peft_config=peft_config,
    )
    seen = []
    original = trainer._generate_and_score_completions

    def spy(inputs):
        out = original(inputs)
        seen.append({k: v.detach().clone() for k, v in out.items() if isinstance(v, torch.Tensor)})
        return out

    trainer._generate_and_score_completions = spy
    return trainer, seen


def _lora_config():
    peft = require_extra("peft")
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_grpo_trainer_runs_on_cbgen(tmp_path, lora, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    peft_config = _lora_config() if lora else None
    rollout = cbgen_rollout_func(num_blocks=128, release_memory=True)
    trainer, seen = _trainer(tmp_path, rollout, peft_config=peft_config)
    trainer.train()

    # Prompts arrived as groups of N equal prompts, one request of n=N each.
    assert rollout.records and all(r.n == N and r.num_prompts == r.num_groups * N for r in rollout.records)
    # The engine saw the optimizer steps (weights change between rollouts) and freed its KV cache.
    llm = rollout.llm_for(trainer)
    assert llm.weight_version >= 1 and not llm.engine.kv_cache.allocated
    assert llm.model is trainer.accelerator.unwrap_model(trainer.model)
    # TRL's own recomputation of the old logprobs equals cbgen's sampling logprobs.
    assert seen
    for out in seen:
        mask = out["completion_mask"].bool()
        old, ours = out["old_per_token_logps"], out["sampling_per_token_logps"]
        assert old.shape == ours.shape and mask.any()
        apart = _ulps_apart(old[mask], ours[mask])
        print(
            f"largest difference {float((old - ours)[mask].abs().max()):.2e}, {float(apart.max()):.0f} ulps"
        )
        assert float(apart.max()) <= ULPS
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)


def test_grpo_trainer_runs_on_a_qwen3_5_hybrid(tmp_path, monkeypatch):
    """A Qwen3.5 hybrid (Gated DeltaNet and attention layers) through TRL's GRPOTrainer: the rollouts'
    logprobs (decode form) equal TRL's recomputation (its forward's chunk form) to rounding, and
    the engine follows the optimizer's weights with its state slots."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    rollout = cbgen_rollout_func(num_blocks=128)
    trainer, seen = _trainer(tmp_path, rollout, model=make_state_model("gdn"))
    trainer.train()
    llm = rollout.llm_for(trainer)
    assert llm.weight_version >= 1 and llm.engine.runner.plan.cache.state_groups
    assert seen
    for out in seen:
        mask = out["completion_mask"].bool()
        old, ours = out["old_per_token_logps"], out["sampling_per_token_logps"]
        assert mask.any()
        # The recurrent and chunk forms round differently: a few float32 ulps of the logits.
        assert float((old - ours)[mask].abs().max()) < 1e-4
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)


def test_grouping_and_generation_kwargs():
    assert _groups(["a", "a", "b", "b", "a", "a"], 2) == [(0, 2), (2, 2), (4, 2)]
    with pytest.raises(ValueError, match="num_generations=2"):
        _groups(["a", "b"], 2)
    conv = [[{"role": "user", "content": "x"}]] * 3
    assert _groups(conv, 3) == [(0, 3)]
    kw = _from_generation_kwargs(
        {"max_new_tokens": 5, "do_sample": False, "suppress_tokens": [7], "top_k": 0}
    )
    assert kw == {"max_tokens": 5, "temperature": 0.0, "logit_bias": {7: float("-inf")}, "top_k": -1}
    with pytest.raises(ValueError, match="num_beams"):
        _from_generation_kwargs({"num_beams": 4})
    with pytest.raises(ValueError, match="logprobs"):
        cbgen_rollout_func(logprobs="sampled")
    with pytest.raises(ValueError):
        cbgen_rollout_func(sampling_overrides={"temperature": -1})


def test_the_ulp_bound_has_power() -> None:
    old = torch.tensor([-5.0, -0.25])
    assert float(_ulps_apart(old, old).max()) == 0
    assert float(_ulps_apart(old, old + 9 * 2.0**-21)[0]) == 9  # float32 ulps in [4, 8) are 2**-21
    assert float(_ulps_apart(old, old + 2.0**-23)[1]) == 1  # below 1: ulps of 1


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-ckpt", "ckpt"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_parity_makes_the_ratio_exactly_one(tmp_path, lora, checkpointing, monkeypatch):
    """``parity=True``: TRL's per-token logprobs (its recomputed "old" ones and the loss's own at the
    first optimizer step after a rollout) equal the rollout's bit for bit, with gradient checkpointing
    on and off, with and without LoRA: |ratio - 1| is exactly 0 on every token."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    peft_config = _lora_config() if lora else None
    rollout = cbgen_rollout_func(num_blocks=128, parity=True)
    trainer, seen = _trainer(tmp_path, rollout, peft_config=peft_config, gradient_checkpointing=checkpointing)
    trainer.train()
    llm = rollout.llm_for(trainer)
    assert llm.engine.plan.parity
    assert seen
    for out in seen:
        mask = out["completion_mask"].bool()
        old, ours = out["old_per_token_logps"], out["sampling_per_token_logps"]
        assert mask.any() and torch.equal(old[mask], ours[mask])
    # The loss's forwards on fresh rollouts (before the optimizer step) were compared too.
    assert len(rollout.parity_ratios) >= 2 and max(rollout.parity_ratios) == 0.0
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)


def test_parity_refuses_a_shaped_distribution(tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    rollout = cbgen_rollout_func(num_blocks=128, parity=True)
    trainer, _ = _trainer(tmp_path, rollout, top_p=0.9)
    with pytest.raises(ValueError, match="truncation"):
        trainer.train()
