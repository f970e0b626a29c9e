"""The real default model: SmolLM2-135M-Instruct in fp32 matches ``generate()`` on chat prompts."""

from __future__ import annotations

import pytest
import torch

from cbgen import LLM, SamplingParams
from cbgen.prompts import chat_conversations
from oracle import compare, hf_greedy


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    from cbgen.model.loading.loader import load_model

    model, tokenizer = load_model(smollm2_path, dtype=torch.float32)
    return model, tokenizer


def test_smollm2_chat_greedy_matches_generate(smollm2):
    model, tokenizer = smollm2
    # 8 conversations x 48 tokens: every prompt checked against generate(), which runs them one by one.
    convs = chat_conversations(8)
    prompts = [
        list(tokenizer.apply_chat_template(c, tokenize=True, add_generation_prompt=True, return_dict=False))
        for c in convs
    ]
    refs = [hf_greedy(model, p, 48) for p in prompts]
    llm = LLM(model, tokenizer)
    outs = llm.chat(convs, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    got = [o.outputs[0].token_ids for o in outs]
    for conv, out in zip(convs, outs):
        print(f"\n>>> {conv[-1]['content']}\n{out.outputs[0].text}")
    near_ties = compare(model, prompts, got, refs)
    print(f"\nnear-ties: {near_ties} of {len(prompts)} prompts")
    # The text is the tokenizer's decoding of the tokens, special tokens skipped.
    assert outs[0].outputs[0].text == tokenizer.decode(got[0], skip_special_tokens=True)
    assert "Paris" in outs[0].outputs[0].text
