"""The state mixers' C kernels (``csrc/cpu_state.c``) and their swap into the engine's forwards
(:mod:`cbgen.model.state_kernels`): the recurrent gated delta rule equals transformers' torch
function bit for bit on many shapes (outputs and the states it leaves in the slots), refuses bad
arguments before C runs, is seen by the engine's thread only, and changes no token or logprob of a
generation.  Also run under AddressSanitizer (``make test-asan``)."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.qwen3_5 import modeling_qwen3_5

from cbgen import LLM, SamplingParams, envs
from cbgen.model import state_kernels, thread_view
from cbgen.model.kernels.cpu.state_ops import conv_update, gdn_recurrent, torch_sum_split
from cbgen.model.state_cache import StepStates
from cbgen.model.state_kernels import CONV_UPDATE, GDN_RECURRENT, StateKernels

pytestmark = pytest.mark.native("c")

MODULE = modeling_qwen3_5
# Under AddressSanitizer the shapes matter, not how many draws of them: fewer examples there.
EXAMPLES = 8 if envs.get("CBGEN_SANITIZE") else 40
REFERENCE = MODULE.__dict__[GDN_RECURRENT]
CONV_REFERENCE = MODULE.__dict__[CONV_UPDATE]


def _inputs(b, t, hk, h, dk, dv, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, hk, dk, generator=g).to(dtype)
    k = torch.randn(b, t, hk, dk, generator=g).to(dtype)
    v = torch.randn(b, t, h, dv, generator=g).to(dtype)
    decay = -torch.rand(b, t, h, generator=g) * 2
    beta = torch.rand(b, t, h, generator=g).to(dtype)
    state = torch.randn(b, h, dk, dv, generator=g)
    return q, k, v, decay, beta, state


def _engaged_rule(q, k, v, decay, beta, state, extra_slots=3, seed=0):
    """The mixers' call as the engine makes it: a StepStates stand-in for the rows' slots, the
    module's function swapped for the kernel.  Returns the output and the rows' new states."""
    b = v.shape[0]
    pool = torch.full((b + extra_slots, *state.shape[1:]), float("nan"))
    slots = torch.randperm(b + extra_slots, generator=torch.Generator().manual_seed(seed))[:b]
    pool[slots] = state
    states = StepStates(
        {("recurrent0", 0): pool}, slots, fresh=False, past=1, in_place=frozenset({("recurrent0", 0)})
    )
    stand_in = states.get_recurrent_state(0)
    assert stand_in.isnan().all() and stand_in.shape == state.shape
    kernels = StateKernels(((MODULE, GDN_RECURRENT),), frozenset({("recurrent0", 0)}))
    with state_kernels.engaged(kernels, states):
        out, final = MODULE.torch_recurrent_gated_delta_rule(
            q,
            k,
            v,
            g=decay,
            beta=beta,
            initial_state=stand_in,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
    assert final is stand_in
    assert states.update_recurrent_state(final, 0) is final  # recognised: nothing stored again
    return out, pool[slots]


def _reference(q, k, v, decay, beta, state):
    return REFERENCE(
        q,
        k,
        v,
        g=decay,
        beta=beta,
        initial_state=state.clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    b=st.integers(1, 4),
    t=st.integers(1, 3),
    hk=st.integers(1, 3),
    group=st.integers(1, 2),
    dk=st.sampled_from([1, 3, 4, 5, 16, 17, 64, 100, 128, 256]),
    dv=st.sampled_from([1, 5, 7, 8, 16, 31, 32, 33, 64, 100, 128, 160]),
    seed=st.integers(0, 2**16),
)
def test_gdn_recurrent_is_the_torch_function_bit_for_bit(b, t, hk, group, dk, dv, seed):
    """Every lane layout torch sums in (blocks of 32 lanes, 8-lane vectors past them, scalar tails,
    rows narrower than a vector) and every cascade depth of the key dimension."""
    inputs = _inputs(b, t, hk, hk * group, dk, dv, seed=seed)
    out, states = _engaged_rule(*inputs, seed=seed)
    ref_out, ref_state = _reference(*inputs)
    assert torch.equal(out, ref_out)
    assert torch.equal(states, ref_state)


def test_gdn_recurrent_in_bf16_and_at_qwen3_5_width():
    """bfloat16 inputs (the function computes in float32 and rounds the output), and a decode batch
    of Qwen3.5's head shape (16 heads of 128 x 128) over the kernel's threading."""
    for dtype, shape in ((torch.bfloat16, (3, 1, 2, 4, 64, 64)), (torch.float32, (6, 1, 16, 16, 128, 128))):
        inputs = _inputs(*shape, dtype=dtype, seed=5)
        out, states = _engaged_rule(*inputs)
        ref_out, ref_state = _reference(*inputs)
        assert out.dtype == dtype and torch.equal(out, ref_out)
        assert torch.equal(states, ref_state)


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    b=st.integers(1, 5),
    channels=st.sampled_from([1, 7, 16, 100, 384]),
    k=st.integers(2, 5),
    extra=st.integers(0, 1),
    activation=st.sampled_from(["silu", None]),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_conv_update_is_the_torch_function_bit_for_bit(b, channels, k, extra, activation, bias, seed):
    """The convolution's decode step through the engine's swap, against transformers' function on
    the same window: the output and the kept inputs left in the slots (``width`` K - 1 or K, as
    models keep them), with and without a bias.  One channel runs transformers' function on the
    gathered window instead."""
    g = torch.Generator().manual_seed(seed)
    width = k - 1 + extra
    x = torch.randn(b, 1, channels, generator=g).transpose(1, 2)  # [B, C, 1] as the mixers pass it
    kept = torch.randn(b, channels, width, generator=g)
    weight = torch.randn(channels, k, generator=g)
    bias_t = torch.randn(channels, generator=g) if bias else None
    pool = torch.full((b + 2, channels, width), float("nan"))
    slots = torch.randperm(b + 2, generator=g)[:b]
    pool[slots] = kept
    states = StepStates({("conv0", 0): pool}, slots, False, 1, in_place=frozenset({("conv0", 0)}))
    with state_kernels.engaged(StateKernels(((MODULE, CONV_UPDATE),), frozenset({("conv0", 0)})), states):
        out = MODULE.causal_conv1d_update(x, states.get_conv_state(0), weight, bias_t, activation)
    ref_kept = kept.clone()
    ref = CONV_REFERENCE(x, ref_kept, weight, bias_t, activation)
    assert torch.equal(out, ref)
    assert torch.equal(pool[slots], ref_kept)


def test_conv_update_refuses_bad_arguments():
    x, weight = torch.randn(2, 8), torch.randn(8, 4)
    states, slots = torch.zeros(3, 8, 4), torch.tensor([0, 2])
    for bad, message in (
        (dict(weight=weight[:, :1].contiguous()), "weight must be"),
        (dict(x=x.double()), "x must be"),
        (dict(states=torch.zeros(3, 8, 2)), "states must be"),
        (dict(slots=torch.tensor([2, 2])), "distinct"),
        (dict(slots=torch.tensor([0, 3])), "distinct and below 3"),
        (dict(bias=torch.zeros(7)), "bias must be"),
    ):
        args = dict(x=x, states=states, slots=slots, weight=weight) | bad
        with pytest.raises(ValueError, match=message):
            conv_update(**args)
    assert not states.any()


def test_torch_sum_split():
    assert [torch_sum_split(w) for w in (1, 4, 7, 8, 31, 32, 63, 64, 128, 160)] == [
        0,
        4,
        4,
        0,
        0,
        32,
        32,
        64,
        128,
        160,
    ]


def _kernel_args(b=2, h=2, t=1, dk=8, dv=8, slots=4):
    q = torch.randn(b, h, t, dk)
    return dict(
        q=q,
        k=torch.randn(b, h, t, dk),
        v=torch.randn(b, h, t, dv),
        decay=torch.rand(b, h, t),
        beta=torch.rand(b, h, t),
        states=torch.zeros(slots, h, dk, dv),
        slots=torch.arange(b, dtype=torch.int64),
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(q=a["q"].double()), "q must be"),
        (lambda a: a.update(k=a["k"][:, :1].expand(2, 2, 1, 8)), "k must be"),
        (lambda a: a.update(v=a["v"][:1]), "k must be"),
        (lambda a: a.update(decay=a["decay"][..., :0]), "decay must be"),
        (lambda a: a.update(states=a["states"][:, :1]), "states must be"),
        (lambda a: a.update(states=a["states"].transpose(2, 3)), "states must be"),
        (lambda a: a.update(slots=a["slots"].int()), "slots must be"),
        (lambda a: a.update(slots=torch.tensor([0, 0])), "distinct"),
        (lambda a: a.update(slots=torch.tensor([1, 4])), "distinct and below 4"),
        (lambda a: a.update(slots=torch.tensor([-1, 0])), "distinct"),
        (
            lambda a: a.update(k=a["k"][:, :, :, :4].contiguous(), q=a["q"][:, :, :, :4].contiguous()),
            "states must be",
        ),
    ],
)
def test_bad_arguments_are_refused_before_the_kernel_runs(change, message):
    args = _kernel_args()
    change(args)
    before = args["states"].clone()
    with pytest.raises(ValueError, match=message):
        gdn_recurrent(**args)
    assert torch.equal(args["states"], before)  # nothing written


def test_the_swap_is_the_engine_threads_only():
    """While the engine's thread has the kernel swapped in, another thread's call of the module's
    function runs transformers' torch function; afterwards the module holds its own function again,
    and a Hold keeps only the dispatch (which calls the original) installed until it is released."""
    inputs = _inputs(2, 1, 2, 2, 16, 16, seed=3)
    ref_out, _ = _reference(*inputs)
    states = StepStates(
        {("recurrent0", 0): torch.zeros(2, 2, 16, 16)},
        torch.arange(2),
        False,
        1,
        in_place=frozenset({("recurrent0", 0)}),
    )
    seen = {}

    def trainer():
        seen["out"], _ = MODULE.torch_recurrent_gated_delta_rule(
            *inputs[:3],
            g=inputs[3],
            beta=inputs[4],
            initial_state=inputs[5].clone(),
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )

    with state_kernels.engaged(
        StateKernels(((MODULE, GDN_RECURRENT),), frozenset({("recurrent0", 0)})), states
    ):
        assert MODULE.__dict__[GDN_RECURRENT] is not REFERENCE
        other = threading.Thread(target=trainer)
        other.start()
        other.join()
    assert torch.equal(seen["out"], ref_out)
    assert MODULE.__dict__[GDN_RECURRENT] is REFERENCE

    hold = thread_view.Hold()
    state_kernels.hold(StateKernels(((MODULE, GDN_RECURRENT),), frozenset({("recurrent0", 0)})), hold)
    assert MODULE.__dict__[GDN_RECURRENT] is not REFERENCE
    trainer()
    assert torch.equal(seen["out"], ref_out)
    hold.release()
    assert MODULE.__dict__[GDN_RECURRENT] is REFERENCE


def test_generation_is_the_same_bits_with_and_without_the_kernel(monkeypatch):
    """Seeded sampled tokens and their logprobs, through prefill, decode batches and a single-row
    decode, are identical with the kernel and with transformers' torch function."""
    from tiny_models import make_state_model

    model = make_state_model("gdn")
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (9, 40, 70)]
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=7, logprobs=2, ignore_eos=True)

    def run():
        llm = LLM(model, block_size=8, max_num_batched_tokens=48)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return llm.engine.runner.plan, [
            (c.token_ids, c.raw_logprobs, c.token_logprobs, c.top_logprobs) for o in outs for c in o.outputs
        ]

    monkeypatch.delenv("CBGEN_STATE_KERNELS", raising=False)  # the default, whatever the caller's shell says
    # Both runs on torch's thread count: a step beside a busy neighbour runs on fewer threads, and a
    # GEMM's bits depend on how many threads split it.
    monkeypatch.setenv("CBGEN_FOLLOW_LOAD", "0")
    plan, with_kernel = run()
    report = plan.report()
    assert plan.state_kernels and "Gated DeltaNet (1 layers)" in report and "convolution (1 layers)" in report
    monkeypatch.setenv("CBGEN_STATE_KERNELS", "0")
    plan, without = run()
    assert not plan.state_kernels and "CBGEN_STATE_KERNELS=0" in plan.report()
    assert with_kernel == without and len(with_kernel) == 3 and all(len(t) == 10 for t, *_ in with_kernel)
