"""Tensor-parallel lockstep as hooks the engine composes, checked in one process: a root whose
channel records what it shares and a follower whose channel replays it, step for step, as two ranks
would over gloo (tests/distributed/test_distributed.py runs the real thing under torchrun)."""

from __future__ import annotations

import copy
from collections import deque
from types import SimpleNamespace

import pytest

from cbgen import LLM, SamplingParams
from cbgen.lockstep import GroupSync, Lockstep, Solo
from tiny_models import make_model, make_prompts

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)


class _Channel:
    """:class:`Lockstep`'s interface over a tape: the root appends what it shares, a follower takes
    the root's values in order."""

    root = 0
    check_digest = Lockstep.check_digest

    def __init__(self, is_root: bool, tape: deque) -> None:
        self.is_root = is_root
        self.tape = tape
        self.topology = SimpleNamespace(rank=0 if is_root else 1)

    def share(self, value=None):
        if self.is_root:
            self.tape.append(copy.deepcopy(value))
            return value
        return self.tape.popleft()


@pytest.fixture(scope="module")
def model():
    return make_model("llama")


def _engine(model, sync=None, **kwargs):
    engine = LLM(model, block_size=8, **kwargs).engine
    if sync is not None:
        engine.lockstep = sync
    return engine


def _finished(outputs) -> dict:
    return {
        o.request_id: ([c.token_ids for c in o.outputs], [c.finish_reason for c in o.outputs])
        for o in outputs
        if o.finished
    }


def _root_run(engine, prompts) -> tuple[dict, list]:
    """Adds the requests, aborts the last one at step 3, runs to the end."""
    for i, p in enumerate(prompts):
        engine.add_request(p, SAMPLED if i == 1 else GREEDY, request_id=f"r{i}")
    outputs, per_step = [], []
    while engine.has_unfinished():
        if engine.stats.steps == 3:
            outputs.append(engine.abort(f"r{len(prompts) - 1}"))
        step = engine.step()
        per_step.append(sorted(o.request_id for o in step))
        outputs += step
    return _finished(outputs), per_step


def test_a_rank_alone_composes_solo_and_has_nothing_to_follow(model):
    engine = _engine(model)
    assert isinstance(engine.lockstep, Solo) and not engine.control.lockstep
    assert not engine.control.is_follower
    engine.follow()  # returns at once
    engine.stop_followers()  # no step
    assert engine.stats.steps == 0


def test_root_hooks_change_nothing_and_a_follower_replays_the_root(model):
    prompts = make_prompts(4, lengths=(3, 30), seed=3)
    alone, _ = _root_run(_engine(model), prompts)
    tape: deque = deque()
    root = _engine(model, GroupSync(_Channel(True, tape)))
    assert root.control.lockstep and not root.control.is_follower
    as_root, root_steps = _root_run(root, prompts)
    assert as_root == alone
    assert as_root["r3"][1] == ["abort"]

    follower = _engine(model, GroupSync(_Channel(False, tape)))
    assert follower.control.is_follower
    for i, p in enumerate(prompts):  # an SPMD program adds the same requests on every rank
        follower.add_request(p, SAMPLED if i == 1 else GREEDY, request_id=f"r{i}")
    assert follower.has_unfinished() and not follower.groups  # waiting for the root's copies
    with pytest.raises(ValueError, match="already in use"):
        follower.add_request(prompts[0], GREEDY, request_id="r0")
    outputs, follower_steps = [], []
    while tape:
        step = follower.step()
        follower_steps.append(sorted(o.request_id for o in step))
        outputs += step
    # The root's abort returned its output at once; the follower returns it from the step that
    # carried the abort out.  Otherwise the ranks return the same outputs from the same steps.
    assert _finished(outputs) == as_root
    assert follower.stats.steps == root.stats.steps
    others = [[[r for r in s if r != "r3"] for s in steps] for steps in (follower_steps, root_steps)]
    assert others[0] == others[1]
    assert ["r3"] in follower_steps and all("r3" not in s for s in root_steps)
    assert not follower.has_unfinished() and follower.block_manager.num_used_blocks == 0


def test_a_follower_that_schedules_otherwise_fails_at_once(model):
    prompts = make_prompts(3, lengths=(20, 40), seed=5)
    tape: deque = deque()
    root = _engine(model, GroupSync(_Channel(True, tape)))
    for i, p in enumerate(prompts):
        root.add_request(p, GREEDY, request_id=f"r{i}")
    root.step()
    follower = _engine(model, GroupSync(_Channel(False, tape)), max_num_batched_tokens=16)
    with pytest.raises(RuntimeError, match="diverged from root"):
        follower.step()


def test_stop_followers_ends_the_follow_loop(model):
    tape: deque = deque()
    root = _engine(model, GroupSync(_Channel(True, tape)))
    root.step()  # an idle heartbeat step
    root.stop_followers()
    follower = _engine(model, GroupSync(_Channel(False, tape)))
    follower.follow()  # runs the two steps, the second says stop
    assert follower.stats.steps == 2 and not tape
