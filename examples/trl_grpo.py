"""TRL's GRPOTrainer with cbgen generating the rollouts: one line, ``rollout_func=cbgen_rollout_func()``.

The rest of this script is an ordinary TRL run, so that the same run can be timed with TRL's own
generation paths too.  ``--backend``:

* ``cbgen``: ``GRPOTrainer(..., rollout_func=cbgen_rollout_func())``;
* ``trl``: TRL's default, ``model.generate()`` on a padded batch;
* ``trl-cb``: TRL's transformers continuous-batching path (``use_transformers_continuous_batching``).

``--model tiny`` (the default) is a 2-layer Llama with SmolLM2's 49,152-token tokenizer: the
vocabulary is real (the sampler's cost is), the forward costs little, so the run measures the
generation backends rather than matrix multiplies.  ``--model tiny-qwen3_5`` is a 4-layer Qwen3.5
hybrid (three Gated DeltaNet layers, one gated full-attention layer) with the same tokenizer.
``--model smollm2`` is SmolLM2-135M-Instruct.
Nothing is downloaded: SmolLM2's tokenizer and weights come from the GGUF bundled with the package.

The task is verifiable and learnable from scratch ("shout"): the reward is the fraction of completion
tokens whose text starts with a capital letter (28% of SmolLM2's vocabulary), so a random policy
scores about 0.28 and one that learned the task approaches 1.

    python examples/trl_grpo.py --steps 40 --max-completion-length 32 --plot reward.png   # reward curve
    python examples/trl_grpo.py --steps 4                     # seconds per step: cbgen, 32 x 128 tokens
    python examples/trl_grpo.py --steps 4 --backend trl       # ... TRL's generate()
    python examples/trl_grpo.py --steps 3 --backend trl-cb    # ... TRL's continuous batching
    python examples/trl_grpo.py --steps 40 --max-completion-length 32 --lora    # LoRA, unmerged
    python examples/trl_grpo.py --steps 4 --parity --gradient-checkpointing  # ratio exactly 1

``--parity`` runs ``cbgen_rollout_func(parity=True)``: the engine in parity mode and TRL's per-token
logprobs computed the engine's way, so the importance ratio between TRL's logprobs and the rollout's
is exactly 1.0 on every token of every step; the run prints the largest |ratio - 1| it measured.

On a machine shared with other jobs, set ``OMP_WAIT_POLICY=PASSIVE``: spinning OpenMP threads that
lose their core made generation 5-10x slower here.

Each run prints one line per step and a summary, and writes ``--out`` (JSON: reward and seconds per
step).  ``--plot PNG`` draws reward against steps for every JSON file given with ``--curves``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import transformers


def _model(kind: str, seed: int):
    """The policy and its tokenizer (see the module docstring)."""
    from cbgen.model.loading.loader import ensure_default_model

    folder = ensure_default_model()
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    tok.padding_side = "left"
    if kind == "smollm2":
        model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        return model, tok
    common = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
    )
    if kind == "tiny-qwen3_5":
        # Qwen3.5's hybrid: Gated DeltaNet and gated full attention layers, 3:1.
        config = transformers.Qwen3_5TextConfig(
            **common,
            num_hidden_layers=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
        )
    else:
        config = transformers.LlamaConfig(**common, num_hidden_layers=2)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


def shout_reward(completion_ids, **kwargs):
    """Fraction of completion tokens whose text starts with a capital letter (see :func:`_capital_tokens`)."""
    return [sum(t in _CAPITAL_TOKENS for t in ids) / max(len(ids), 1) for ids in completion_ids]


_CAPITAL_TOKENS: set[int] = set()


def _capital_tokens(tok) -> set[int]:
    return {i for i in tok.get_vocab().values() if tok.decode([i]).strip()[:1].isupper()}


class _Timer(transformers.TrainerCallback):
    """Wall time of every optimizer step (TRL generates inside the step) and of its generation."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.generation: list[float] = []
        self._t = 0.0
        self._gen = 0.0

    def wrap(self, trainer) -> None:
        """Times ``trainer._generate``: every backend's generation, tokenising and decoding included."""
        inner = trainer._generate

        def timed(prompts):
            t = time.perf_counter()
            try:
                return inner(prompts)
            finally:
                self._gen += time.perf_counter() - t

        trainer._generate = timed

    def on_step_begin(self, args, state, control, **kwargs):
        self._t, self._gen = time.perf_counter(), 0.0

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self._t)
        self.generation.append(self._gen)
        print(
            f"step {state.global_step:3d}  {self.seconds[-1]:6.2f} s, generation {self._gen:6.2f} s",
            flush=True,
        )


def run(args: argparse.Namespace) -> dict:
    """One training run; returns what ``--out`` holds."""
    import datasets
    import trl

    from cbgen.integrations.trl import cbgen_rollout_func
    from cbgen.prompts import CHAT_INSTRUCTIONS

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    model, tok = _model(args.model, args.seed)
    _CAPITAL_TOKENS.update(_capital_tokens(tok))
    prompts = CHAT_INSTRUCTIONS * (1 + args.steps * args.prompts_per_step // len(CHAT_INSTRUCTIONS))
    config = trl.GRPOConfig(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.prompts_per_step * args.num_generations,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        max_steps=args.steps,
        learning_rate=args.lr,
        beta=0.0,
        bf16=False,  # on CPU, bf16 autocast makes TRL's logprobs differ from the sampler's by ~1e-3
        use_cpu=not torch.cuda.is_available(),
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        seed=args.seed,
        use_transformers_continuous_batching=args.backend == "trl-cb",
        gradient_checkpointing=args.gradient_checkpointing,
    )
    peft_config = None
    if args.lora:
        import peft

        peft_config = peft.LoraConfig(
            r=16,
            lora_alpha=32,
            target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
            task_type="CAUSAL_LM",
        )
    rollout = None
    if args.backend == "cbgen":
        rollout = cbgen_rollout_func(release_memory=args.release_memory, parity=args.parity)
    timer = _Timer()
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=shout_reward,
        args=config,
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
        processing_class=tok,
        rollout_func=rollout,
        peft_config=peft_config,
        callbacks=[timer],
    )
    timer.wrap(trainer)
    trainer.train()
    rewards = [e["reward"] for e in trainer.state.log_history if "reward" in e]
    # The first step carries one-off costs (engine start, kernel builds); the median skips it.
    steady = timer.seconds[1:] or timer.seconds
    steady_gen = timer.generation[1:] or timer.generation
    return {
        "backend": args.backend,
        "model": args.model,
        "lora": args.lora,
        "steps": args.steps,
        "completions_per_step": args.prompts_per_step * args.num_generations,
        "max_completion_length": args.max_completion_length,
        "reward": rewards,
        "seconds_per_step": timer.seconds,
        "median_seconds_per_step": statistics.median(steady),
        "generation_seconds_per_step": timer.generation,
        "median_generation_seconds_per_step": statistics.median(steady_gen),
        "torch_threads": torch.get_num_threads(),
        "parity": args.parity,
        "gradient_checkpointing": args.gradient_checkpointing,
        # parity: per check (the loss's forward over a fresh rollout), the largest |ratio - 1|.
        "parity_max_abs_ratio_minus_1": rollout.parity_ratios
        if rollout is not None and args.parity
        else None,
    }


def plot(curves: list[Path], out: Path) -> None:
    """Reward against steps for each JSON result file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for path in curves:
        data = json.loads(path.read_text())
        label = f"{data['backend']}{' + LoRA' if data['lora'] else ''} ({data['median_seconds_per_step']:.1f} s/step)"
        ax.plot(range(1, len(data["reward"]) + 1), data["reward"], label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward (capitalised-token fraction)")
    ax.set_title("TRL GRPOTrainer, rollouts from cbgen")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    """Command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--backend", choices=["cbgen", "trl", "trl-cb"], default="cbgen")
    ap.add_argument("--model", choices=["tiny", "tiny-qwen3_5", "smollm2"], default="tiny")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--max-completion-length", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-2)
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--release-memory", action="store_true", help="cbgen: free the KV cache while training")
    ap.add_argument("--parity", action="store_true", help="cbgen: TRL's logprobs bit for bit the rollout's")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-dir", default="/tmp/cbgen-trl-grpo")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    ap.add_argument("--plot", type=Path, default=None, help="draw reward against steps to this PNG")
    ap.add_argument(
        "--curves", type=Path, nargs="*", default=[], help="JSON results to plot (default: this run)"
    )
    args = ap.parse_args()
    if args.plot and args.curves:
        plot(args.curves, args.plot)
        return
    if args.parity and args.backend != "cbgen":
        ap.error("--parity needs --backend cbgen")
    result = run(args)
    r = result["reward"]
    print(
        f"{args.backend}: {result['median_seconds_per_step']:.2f} s/step, of which generation "
        f"{result['median_generation_seconds_per_step']:.2f} s (medians after the first step), "
        f"reward {r[0]:.3f} -> {r[-1]:.3f} (mean of the last 5: {statistics.mean(r[-5:]):.3f})"
    )
    ratios = result["parity_max_abs_ratio_minus_1"]
    if ratios is not None:
        print(
            f"parity: largest |ratio - 1| over {len(ratios)} checks (every token of each step): {max(ratios, default=0.0)}"
        )
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    if args.plot:
        path = args.out or Path(args.output_dir) / "result.json"
        path.write_text(json.dumps(result, indent=1))
        plot([path], args.plot)


if __name__ == "__main__":
    main()
