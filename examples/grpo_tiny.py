"""GRPO on CPU in well under a minute: cbgen samples the rollouts from the very module being trained.

The policy is a tiny random Llama over a 7-token vocabulary (``<pad> <s> </s> a b c d``).  The task is
verifiable: a prompt is ``<s>`` followed by a few letters, and the reward is the fraction of the
``max_tokens`` completion slots that repeat the prompt's last letter.  A random policy scores about
1/7, one that only learned to emit letters 1/4, and one that learned to echo 1.

Each step:

1. ``llm.generate`` draws a group of ``n`` samples per prompt at temperature 1.  The ``LLM`` is built
   once around the trainer's module; it notices the optimizer's in-place updates by itself, drops its
   prefix cache and stamps each output with the ``weight_version`` it was computed under.
2. Rewards are normalised within each group (the GRPO advantage), so no value network is needed.
3. A PPO-clip loss is optimised for a few epochs.  The behaviour log-probabilities are cbgen's
   ``raw_logprobs`` (``log_softmax`` of the raw logits at temperature 1): no second forward pass is
   spent on "old" log-probabilities, and on the first epoch the importance ratio is 1 up to rounding,
   which the script measures and reports.

Run ``python examples/grpo_tiny.py --steps 40`` (``--help`` for the knobs).  With ``--parity`` the
engine runs in parity mode and the trainer's forwards inside ``cbgen.parity(policy)``: the
behaviour log-probabilities then equal the trainer's exactly, and the ratio on fresh rollouts is
exactly 1 (``max |ratio-1| 0.0e+00``).  It prints the mean reward
per step, saves the reward curve as a PNG and exits non-zero unless the reward clearly rose.

Data parallel: ``torchrun --nproc-per-node 2 examples/grpo_tiny.py --steps 30``.  Every rank holds a
replica of the policy (wrapped in ``DistributedDataParallel``, gloo on CPU), draws the same prompt
list and keeps its share of it, generates its rollouts with its own cbgen engine on its own replica,
and the gradients are averaged across ranks; the logged reward is the mean over all ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers

import cbgen
from cbgen import LLM, SamplingParams

PAD, BOS, EOS = 0, 1, 2
LETTERS = "abcd"
VOCAB = ["<pad>", "<s>", "</s>", *LETTERS]
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "grpo_reward.png"


@dataclass
class GRPOConfig:
    """Hyper-parameters of one run; the defaults learn the echo task in about 20 steps."""

    steps: int = 40
    seed: int = 0
    prompts_per_step: int = 16
    group_size: int = 8  # n samples per prompt: the "group" whose rewards are normalised
    max_tokens: int = 8
    prompt_letters: tuple[int, int] = (3, 6)  # inclusive range of letters after <s>
    lr: float = 3e-3
    clip_eps: float = 0.2
    ppo_epochs: int = 4  # updates per batch of rollouts: later epochs are off-policy, hence the clip
    release_kv: bool = False  # free the KV cache while training (what a GPU run short of memory does)
    # Trainer parity: the engine runs with batch_invariant=True and the trainer's forwards inside
    # cbgen.parity(policy), so on fresh rollouts the importance ratio is exactly 1.
    parity: bool = False
    out: Path | None = DEFAULT_OUT
    log: bool = True


@dataclass
class GRPOResult:
    """What a run produced: one entry per step."""

    rewards: list[float] = field(default_factory=list)  # mean reward over the step's rollouts
    ratio_errors: list[float] = field(default_factory=list)  # max |ratio - 1| before the first update
    weight_versions: list[int] = field(default_factory=list)  # the version the rollouts were drawn under
    seconds: float = 0.0
    png: Path | None = None

    def first(self, k: int = 5) -> float:
        """Mean reward of the first ``k`` steps."""
        head = self.rewards[:k]
        return sum(head) / len(head)

    def last(self, k: int = 5) -> float:
        """Mean reward of the last ``k`` steps."""
        tail = self.rewards[-k:]
        return sum(tail) / len(tail)

    @property
    def improved(self) -> bool:
        """True when the late reward beats the early one by a clear margin."""
        k = max(1, min(5, len(self.rewards) // 4))
        return self.last(k) > self.first(k) + 0.2


def build_policy(seed: int) -> transformers.LlamaForCausalLM:
    """A small random Llama over :data:`VOCAB` (nothing is downloaded)."""
    config = transformers.LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        # Tied embeddings give "predict the current token" a head start, which the echo task builds on.
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    model.generation_config.eos_token_id = EOS
    return model


def make_prompts(rng: random.Random, count: int, letters: tuple[int, int]) -> list[list[int]]:
    """``<s>`` plus a random run of letters per prompt."""
    first_letter = len(VOCAB) - len(LETTERS)
    return [
        [BOS, *(rng.randrange(first_letter, len(VOCAB)) for _ in range(rng.randint(*letters)))]
        for _ in range(count)
    ]


def reward(prompt: Sequence[int], completion: Sequence[int], max_tokens: int) -> float:
    """Fraction of the ``max_tokens`` slots that repeat the prompt's last letter.

    Dividing by ``max_tokens`` rather than by the completion's length means stopping early (EOS)
    can only lose reward, so the policy cannot game the ratio by emitting one right letter and stopping.
    """
    target = prompt[-1]
    return sum(token == target for token in completion) / max_tokens


def completion_logprobs(
    model: torch.nn.Module, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's log-probabilities of each completion token: ``[B, T]`` values and a ``[B, T]`` mask.

    One fp32 forward over right-padded ``prompt + completion`` rows.  Right padding needs no attention
    mask: attention is causal, so pad tokens only ever follow the positions that are read.  The
    log-softmax is ``cbgen.token_logprobs``, the function parity mode's engine reports with.
    """
    rows = [list(p) + list(c) for p, c in zip(prompts, completions)]
    width = max(map(len, rows))
    input_ids = torch.tensor([r + [PAD] * (width - len(r)) for r in rows])
    logits = model(input_ids=input_ids).logits.float()
    longest = max(len(c) for c in completions)
    # Row i's completion token j sits at position len(prompt)+j and is predicted from one position earlier.
    # Padding slots of short completions may point past the row: clamp them; the mask drops them anyway.
    positions = torch.tensor([[len(p) - 1 + j for j in range(longest)] for p in prompts]).clamp_max(width - 2)
    targets = torch.tensor([list(c) + [PAD] * (longest - len(c)) for c in completions])
    mask = torch.tensor([[j < len(c) for j in range(longest)] for c in completions])
    picked = logits.gather(1, positions[..., None].expand(-1, -1, logits.shape[-1]))
    return cbgen.token_logprobs(picked, targets), mask


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """GRPO advantages: each reward minus its group's mean, over the group's std (0 for a flat group)."""
    grouped = rewards.view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    return (centred / (grouped.std(dim=1, keepdim=True) + 1e-4)).view(-1)


def ppo_clip_loss(
    new_logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, eps: float
) -> torch.Tensor:
    """Token-level clipped surrogate, averaged over all completion tokens of the batch."""
    ratio = torch.exp(new_logp - old_logp)
    adv = advantages[:, None]
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1.0 - eps, 1.0 + eps) * adv)
    return -(surrogate * mask).sum() / mask.sum().clamp_min(1)


def save_curve(rewards: Sequence[float], path: Path) -> Path:
    """Plots mean reward per step to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")  # headless: CI and servers have no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
    ax.plot(range(1, len(rewards) + 1), rewards, marker="o", markersize=3, lw=1.5)
    ax.axhline(1 / len(LETTERS), color="grey", ls="--", lw=1, label="a random letter")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(0, 1.02)
    ax.set_title("GRPO with cbgen rollouts: echo the prompt's last letter")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _data_parallel() -> tuple[int, int]:
    """(rank, world size): under torchrun the process group is started here (gloo on CPU)."""
    import os

    import torch.distributed as dist

    if "RANK" not in os.environ:
        return 0, 1
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def _mean_over_ranks(value: float, world: int) -> float:
    if world == 1:
        return value
    total = torch.tensor([value])
    torch.distributed.all_reduce(total)
    return float(total) / world


def train(cfg: GRPOConfig) -> GRPOResult:
    """Runs ``cfg.steps`` GRPO steps and returns the per-step record."""
    start = time.perf_counter()
    rank, world = _data_parallel()
    rng = random.Random(cfg.seed)
    policy = build_policy(cfg.seed)  # the same initial weights on every rank
    policy.train()
    # Under torchrun the trainer's forward goes through DDP (gradients averaged across ranks); cbgen
    # runs on the same underlying module, as it would on a single process.
    trainer = policy if world == 1 else torch.nn.parallel.DistributedDataParallel(policy)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=0.0)
    # One engine for the whole run, sharing the trainer's module: nothing is copied or synced by hand.
    # Each rank seeds its own draws: the replicas must not sample the same completions.
    llm = LLM(policy, block_size=8, num_blocks=128, seed=cfg.seed + rank, batch_invariant=cfg.parity)
    forward_mode = (lambda: cbgen.parity(policy)) if cfg.parity else contextlib.nullcontext
    sampling = SamplingParams(n=cfg.group_size, temperature=1.0, max_tokens=cfg.max_tokens)
    result = GRPOResult()

    for step in range(1, cfg.steps + 1):
        prompts = make_prompts(rng, cfg.prompts_per_step, cfg.prompt_letters)[rank::world]
        if cfg.release_kv:
            llm.resume_memory()
        outs = llm.generate(prompts, sampling, use_tqdm=False)
        if cfg.release_kv:
            llm.release_memory()
        flat_prompts = [out.prompt_token_ids for out in outs for _ in out.outputs]
        completions = [sample.token_ids for out in outs for sample in sample_order(out.outputs)]
        old = [sample.raw_logprobs for out in outs for sample in sample_order(out.outputs)]
        rewards = torch.tensor([reward(p, c, cfg.max_tokens) for p, c in zip(flat_prompts, completions)])
        advantages = group_advantages(rewards, cfg.group_size)
        longest = max(map(len, completions))
        old_logp = torch.tensor([lp + [0.0] * (longest - len(lp)) for lp in old])

        ratio_error = float("nan")
        for epoch in range(cfg.ppo_epochs):
            with forward_mode():
                new_logp, mask = completion_logprobs(trainer, flat_prompts, completions)
                loss = ppo_clip_loss(new_logp, old_logp, advantages, mask, cfg.clip_eps)
            if epoch == 0:
                # Same weights as the rollout: the ratio is 1 up to rounding (fp32 packed vs padded),
                # exactly 1 with --parity.
                ratio_error = float(((new_logp.detach() - old_logp).exp() - 1).abs()[mask].max())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

        result.rewards.append(_mean_over_ranks(float(rewards.mean()), world))
        result.ratio_errors.append(ratio_error)
        result.weight_versions.append(outs[0].weight_version)
        if cfg.log and rank == 0:
            print(
                f"step {step:3d}  reward {result.rewards[-1]:.3f}  |ratio-1| {ratio_error:.1e}  "
                f"weights v{outs[0].weight_version}  e.g. {show(flat_prompts[0][1:])} -> {show(completions[0])}",
                flush=True,
            )

    result.seconds = time.perf_counter() - start
    if cfg.out is not None and rank == 0:
        result.png = save_curve(result.rewards, cfg.out)
    return result


def show(tokens: Sequence[int]) -> str:
    """Letters as themselves, special tokens as ``.``."""
    return "".join(VOCAB[t] if t > EOS else "." for t in tokens)


def sample_order(samples: Sequence) -> list:
    """Samples by index, so each group's rows are contiguous and in a fixed order."""
    return sorted(samples, key=lambda s: s.index)


def main(argv: Sequence[str] | None = None) -> GRPOResult:
    """Command-line entry point; returns the run's :class:`GRPOResult`."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--steps", type=int, default=GRPOConfig.steps, help="GRPO steps (default %(default)s)"
    )
    parser.add_argument(
        "--seed", type=int, default=GRPOConfig.seed, help="seed for model, prompts and sampling"
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="reward-curve PNG (default %(default)s)"
    )
    parser.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    parser.add_argument(
        "--parity",
        action="store_true",
        help="trainer parity: batch_invariant engine + cbgen.parity forwards (ratio exactly 1)",
    )
    parser.add_argument("--release-kv", action="store_true", help="free the KV cache during each update")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default %(default)s)")
    parser.add_argument("--quiet", action="store_true", help="only print the summary")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2")
    torch.set_num_threads(args.threads)
    cfg = GRPOConfig(
        steps=args.steps,
        seed=args.seed,
        release_kv=args.release_kv,
        parity=args.parity,
        out=None if args.no_plot else args.out,
        log=not args.quiet,
    )
    result = train(cfg)
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return result
    k = max(1, min(5, len(result.rewards) // 4))
    print(
        f"mean reward: first {k} steps {result.first(k):.3f} -> last {k} steps {result.last(k):.3f} "
        f"({result.seconds:.1f} s; max |ratio-1| on fresh rollouts {max(result.ratio_errors):.1e})"
    )
    if result.png is not None:
        print(f"reward curve: {result.png}")
    return result


if __name__ == "__main__":
    outcome = main()
    if torch.distributed.is_initialized():
        # Stop gloo's threads before interpreter teardown: left to static destructors, a still-joinable
        # thread aborted rank 0 at exit once ("terminate called without an active exception").
        torch.distributed.destroy_process_group()
    sys.exit(0 if outcome.improved else 1)
