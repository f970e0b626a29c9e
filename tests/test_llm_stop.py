"""Stop strings on the real tokenizer: matched across token boundaries, cut correctly."""

from __future__ import annotations

import pytest
import torch

from cbgen import LLM, SamplingParams

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm(smollm2_path):
    from cbgen.model.loading.loader import load_model

    model, tokenizer = load_model(smollm2_path, dtype=torch.float32)
    return LLM(model, tokenizer, block_size=16)


@pytest.fixture(scope="module")
def async_llm(llm):
    """The same model under overlap scheduling (stop checks one step late)."""
    return LLM(llm.model, llm.tokenizer, block_size=16, async_scheduling=True)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_greedy_answer_and_stop_string_spanning_tokens(llm, async_llm, mode):
    llm = async_llm if mode == "async" else llm
    full = llm.chat(QUESTION, SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)[0].outputs[0]
    assert "capital of France is Paris" in full.text
    ids = full.token_ids
    pieces = [llm.tokenizer.decode([t]) for t in ids]
    # choose a stop string made of the end of one token and the start of the next
    i = next(k for k, p in enumerate(pieces) if p.strip() == "France")
    stop = pieces[i - 1][-2:] + pieces[i][:3]
    assert len(stop) == 5 and stop in full.text

    cut = llm.chat(QUESTION, SamplingParams(max_tokens=20, temperature=0, stop=[stop]), use_tqdm=False)[
        0
    ].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[: full.text.index(stop)]
    assert cut.token_ids == ids[: i + 1], "generation stops at the token that completes the stop string"

    kept = llm.chat(
        QUESTION,
        SamplingParams(max_tokens=20, temperature=0, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == full.text[: full.text.index(stop) + len(stop)]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_eos_ends_generation_and_is_not_in_text(llm, async_llm, mode):
    llm = async_llm if mode == "async" else llm
    out = llm.chat(QUESTION, SamplingParams(max_tokens=200, temperature=0), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == 2
    assert "<|im_end|>" not in out.text
    raw = llm.chat(
        QUESTION, SamplingParams(max_tokens=200, temperature=0, skip_special_tokens=False), use_tqdm=False
    )[0].outputs[0]
    assert raw.text.endswith("<|im_end|>")


def test_smollm2_raw_logprobs_match_plain_forward(llm):
    """raw_logprob is the temperature-1 log-softmax of the unmodified model: a plain fp32 forward over
    prompt + completion reproduces it for every sampled token."""
    prompt = llm.tokenizer.apply_chat_template(
        QUESTION, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    params = SamplingParams(n=2, max_tokens=24, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
    out = llm.generate([list(prompt)], params, use_tqdm=False)[0]
    for c in out.outputs:
        ids = torch.tensor([list(prompt) + c.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(llm.model(ids).logits[0].double(), -1)
        ref = [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(c.token_ids)]
        assert max(abs(a - b) for a, b in zip(c.raw_logprobs, ref)) < 1e-4
