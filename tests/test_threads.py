"""An engine generating on one thread while a trainer uses the same module on another (an
asynchronous RL loop): every engine output equals the engine's output alone, every trainer
forward and backward equals its result alone (or raises a clear error), and once both have
stopped the model is exactly as it was: attention implementation, training flags, hooks,
checkpoint functions (``cbgen.model.thread_view``, ``cbgen.batch_invariant.context``).

The CI test runs a fixed number of rounds on each side; ``test_thread_soak`` runs for
``CBGEN_SOAK_MINUTES`` (``make soak``).  No assertion reads a clock.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

import cbgen
from cbgen import LLM, SamplingParams
from cbgen.model import thread_view
from tiny_models import make_model, make_prompts, make_wide_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@dataclass
class Case:
    """One engine setup and the trainer work run beside it."""

    name: str
    model: Callable[[], torch.nn.Module]
    engine: dict
    train_mode: bool = False  # the trainer's model in training mode (dropout on where it has any)


CASES = [
    # The fused C forward (default CPU path): no module of the model is called by a step.
    Case("fused", lambda: make_wide_model("llama"), {}),
    # Parity mode's direct forward beside the trainer's parity forwards.
    Case("parity", lambda: make_wide_model("llama"), {"batch_invariant": True}),
    # The module forward (Phi-3 is not on the fused path), on a model in training mode with residual
    # dropout: each step needs paged attention and eval mode on its own thread while the trainer's
    # forwards draw dropout on theirs.
    Case("module-train", lambda: make_model("phi3", resid_pdrop=0.1), {}, train_mode=True),
    # The module forward in eval mode, with the trainer's parity forwards beside it.
    Case("module-eval", lambda: make_model("phi3"), {}),
]


def _state(model: torch.nn.Module) -> tuple:
    """What must be exactly as before once every thread has stopped."""
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    ckpt = [m.__dict__.get("_gradient_checkpointing_func") for m in model.modules()]
    return (
        model.config._attn_implementation,
        model.config._attn_implementation_internal,
        tuple(m.training for m in model.modules()),
        hooks,
        tuple(map(id, ckpt)),
        type(model.config),
        type(model),
    )


@dataclass
class Trainer:
    """The trainer thread's work and what it saw."""

    model: torch.nn.Module
    train_mode: bool
    ids: torch.Tensor = field(init=False)
    mask: torch.Tensor = field(init=False)
    wrong: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    rounds: int = 0

    def __post_init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        vocab = self.model.config.vocab_size
        self.ids = torch.randint(3, vocab, (3, 24), generator=g)
        self.mask = torch.ones_like(self.ids)
        self.mask[0, :7] = 0  # a left-padded row
        self.mask[2, :2] = 0

    def parity_logits(self) -> torch.Tensor:
        with torch.no_grad(), cbgen.parity(self.model):
            # The mask passed positionally, as the model's second argument.
            return self.model(self.ids, self.mask).logits

    def plain_logits(self) -> torch.Tensor:
        torch.manual_seed(7)  # dropout draws, when the model is in training mode
        with torch.no_grad():
            return self.model(self.ids, attention_mask=self.mask).logits

    def grads(self) -> torch.Tensor:
        self.model.zero_grad(set_to_none=True)
        torch.manual_seed(8)
        out = self.model(self.ids, attention_mask=self.mask).logits
        out.float().logsumexp(-1).mean().backward()
        grad = next(self.model.model.layers[0].self_attn.parameters()).grad.clone()
        self.model.zero_grad(set_to_none=True)
        return grad

    def checks(self) -> dict[str, Callable[[], torch.Tensor]]:
        found = {"plain": self.plain_logits, "grads": self.grads}
        if not self.train_mode:  # parity forwards compute attention without dropout
            found["parity"] = self.parity_logits
        return found

    def references(self) -> dict[str, torch.Tensor]:
        return {name: fn() for name, fn in self.checks().items()}

    def run(self, refs: dict[str, torch.Tensor], keep_going: Callable[[], bool]) -> None:
        while keep_going():
            for name, fn in self.checks().items():
                try:
                    got = fn()
                except Exception as exc:  # a clear error is allowed; it is reported below
                    self.errors.append(f"{name}: {type(exc).__name__}: {exc}")
                    continue
                if not torch.equal(got, refs[name]):
                    self.wrong.append(
                        f"{name} round {self.rounds}: max diff {(got - refs[name]).abs().max()}"
                    )
            self.rounds += 1


def _stress(case: Case, engine_rounds: int | None, minutes: float | None = None) -> None:
    model = case.model()
    if case.train_mode:
        model.train()
    before = _state(model)
    trainer = Trainer(model, case.train_mode)
    refs = trainer.references()
    assert _state(model) == before

    llm = LLM(model, seed=0, **case.engine)
    prompts = make_prompts(8, (3, 40), vocab=model.config.vocab_size, seed=3)
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    sampled = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=6)

    def generate(engine: LLM) -> list[list[int]]:
        outs = engine.generate(prompts, greedy, use_tqdm=False)
        outs += engine.generate(prompts[:3], sampled, use_tqdm=False)
        return [c.token_ids for o in outs for c in o.outputs]

    want = generate(llm)
    engine_wrong: list[int] = []
    engine_errors: list[str] = []
    done = threading.Event()
    trainer_started = threading.Event()

    def engine_loop(engine: LLM) -> None:
        trainer_started.wait(60)
        deadline = time.monotonic() + 60 * minutes if minutes else None
        i = 0
        try:
            while (engine_rounds is not None and i < engine_rounds) or (
                deadline is not None and time.monotonic() < deadline
            ):
                try:
                    if generate(engine) != want:
                        engine_wrong.append(i)
                except Exception as exc:
                    engine_errors.append(f"{type(exc).__name__}: {exc}")
                i += 1
        finally:
            done.set()

    rounds_at_least = 2

    def keep_going() -> bool:
        trainer_started.set()
        return not done.is_set() or trainer.rounds < rounds_at_least

    engine_thread = threading.Thread(target=engine_loop, args=(llm,))
    engine_thread.start()
    try:
        trainer.run(refs, keep_going)
    finally:
        done.wait(600)
        engine_thread.join(600)
    assert not engine_thread.is_alive()
    assert engine_errors == []
    assert engine_wrong == [], f"{len(engine_wrong)} engine rounds differ from the engine alone"
    assert trainer.errors == []
    assert trainer.wrong == [], trainer.wrong[:5]
    assert trainer.rounds >= rounds_at_least
    assert _state(model) == before
    # The engine's own hold on the thread-view properties ends with the engine.
    del llm
    import gc

    gc.collect()
    assert thread_view.installed() == []
    assert _state(model) == before


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_engine_and_trainer_on_two_threads(case: Case) -> None:
    """A bounded run: four engine rounds (each 8 greedy prompts and 3 sampled n=2 ones) beside the
    trainer's parity forwards, plain forwards and backward passes, at least two rounds of them."""
    _stress(case, engine_rounds=4)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("CBGEN_SOAK_MINUTES"), reason="the soak runs under make soak")
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_thread_soak(case: Case) -> None:
    """The same for ``CBGEN_SOAK_MINUTES`` minutes per case."""
    _stress(case, engine_rounds=None, minutes=float(os.environ["CBGEN_SOAK_MINUTES"]))
