"""A fake ``vllm`` package for the benchmark's vLLM subprocess protocol (vLLM itself is not a test
dependency): ``LLM.generate`` returns deliberately wrong tokens (7s), so a report must refuse to
trust them, and notes each call in ``$FAKE_VLLM_CALLS``; ``LLM.llm_engine`` streams one token a step
(``prompt length % 97``) for the ``long`` workload's step loop."""

from __future__ import annotations

import textwrap

FAKE_VLLM = textwrap.dedent(
    """
    __version__ = "0.0-fake"

    class SamplingParams:
        def __init__(self, n=1, max_tokens=16, **kwargs):
            self.n, self.max_tokens = n, max_tokens

    class _Completion:
        def __init__(self, index, token_ids):
            self.index, self.token_ids = index, token_ids

    class _Output:
        metrics = None

        def __init__(self, outputs, finished=True):
            self.outputs, self.finished = outputs, finished

    class _Engine:
        def __init__(self):
            self.live = {}

        def add_request(self, rid, prompt, params):
            self.live[rid] = (len(prompt["prompt_token_ids"]), params.max_tokens, [])

        def has_unfinished_requests(self):
            return bool(self.live)

        def step(self):
            out = []
            for rid, (n, want, toks) in list(self.live.items()):
                toks.append(n % 97)
                out.append(_Output([_Completion(0, list(toks))], len(toks) == want))
                if len(toks) == want:
                    del self.live[rid]
            return out

    class LLM:
        def __init__(self, model, **kwargs):
            self.model = model
            self.llm_engine = _Engine()

        def generate(self, prompts, params, use_tqdm=True):
            import os

            if os.environ.get("FAKE_VLLM_CALLS"):
                with open(os.environ["FAKE_VLLM_CALLS"], "a") as f:
                    f.write("generate\\n")
            return [_Output([_Completion(j, [7] * p.max_tokens) for j in range(p.n)]) for p in params]
    """
)
