"""The support matrix in CI: a fixed subset of transformers' causal-LM mapping, one entry per kind of
result and per refusal reason, each held to its committed result; and the committed table in
docs/models.md covers every entry of the installed mapping (``make models`` regenerates it)."""

from __future__ import annotations

import pathlib
import re

import pytest
import shrink

import matrix

# model type -> (expected kind, a phrase the refusal reason must contain).  Exact entries cover the
# fused C forward (llama, qwen3), the module forward, sliding windows (gemma2), MoE (mixtral),
# chunked attention (llama4), a decoder layer that drops its kwargs (stablelm: the metadata reaches
# attention through the step's context variable), learned absolute positions (gpt2, opt) and
# attention sinks (gpt_oss).
SUBSET: dict[str, tuple[str, str]] = {
    "llama": (matrix.EXACT, ""),
    "qwen3": (matrix.EXACT, ""),
    "gemma2": (matrix.EXACT, ""),
    "mixtral": (matrix.EXACT, ""),
    "stablelm": (matrix.EXACT, ""),
    "gpt2": (matrix.EXACT, ""),
    "opt": (matrix.EXACT, ""),
    "llama4_text": (matrix.EXACT, ""),
    "phi": (matrix.EXACT, ""),
    "gpt_oss": (matrix.EXACT, ""),  # attention sinks, sliding and full layers
    # State layers, one entry per mixer kind: Gated DeltaNet (qwen3_5_text), Mamba2 (nemotron_h),
    # Mamba1 (mamba; jamba, whose Mamba1 cannot continue a multi-token forward: one-piece prompts, no
    # prefix hits), short convolution (lfm2), attention and Mamba2 in one layer (falcon_h1); and the
    # refused ones: state on the module (recurrent_gemma), a legacy cache API (minimax), a sparse
    # indexer (qwen4_exp_text).
    "qwen3_5_text": (matrix.EXACT, ""),
    "nemotron_h": (matrix.EXACT, ""),
    "mamba": (matrix.EXACT, ""),
    "jamba": (matrix.EXACT, "no prefix hits"),
    "lfm2": (matrix.EXACT, ""),
    "falcon_h1": (matrix.EXACT, ""),
    "recurrent_gemma": (matrix.REFUSED, "keep their state elsewhere"),
    "minimax": (matrix.REFUSED, "uses cache of its own"),
    "qwen4_exp_text": (matrix.REFUSED, "indexer"),
    "bart": (matrix.REFUSED, "not causal"),
    "bert": (matrix.EXACT, ""),  # an encoder family's decoder (is_decoder=True), absolute positions
    "roberta": (matrix.REFUSED, "different logits"),  # positions from input_ids, not position_ids
    "doge": (matrix.REFUSED, "its own attention mask"),
    "bloom": (matrix.REFUSED, "no `layer_idx`"),
    "diffllama": (matrix.REFUSED, "times per forward"),
    # Latent attention (keys 32, values 16), Gemma 4 (per-layer head sizes), JetMoE (tiled KV heads).
    "deepseek_v3": (matrix.EXACT, ""),
    "gemma4_text": (matrix.EXACT, ""),
    "jetmoe": (matrix.EXACT, ""),
    "dory": (matrix.REFUSED, "times per forward"),
    "moshi": (matrix.EXACT_FORWARD, "generate() differs"),
}


@pytest.fixture(scope="module", autouse=True)
def _quiet():
    matrix.quiet()


@pytest.mark.parametrize("model_type", list(SUBSET))
def test_matrix_entry_keeps_its_result(model_type):
    kind, phrase = SUBSET[model_type]
    result = matrix.run_one(model_type)
    assert result.kind == kind, f"{model_type}: {result.kind} ({result.detail}), committed: {kind}"
    assert phrase in result.detail, f"{model_type}: reason {result.detail!r} lacks {phrase!r}"


def test_committed_matrix_covers_the_installed_mapping():
    """docs/models.md lists every entry of the installed mapping, and none is wrong or crashed."""
    text = (pathlib.Path(__file__).parents[2] / "docs" / "models.md").read_text()
    rows = {}
    for line in text.splitlines():
        match = re.match(r"^\| `([^`]+)` \| ", line)
        if match:
            cells = [c.strip() for c in line.split(" | ")]
            rows[match.group(1)] = cells[2:4]  # the float32 and bfloat16 results
    assert set(rows) == set(shrink.mapping()), "docs/models.md is stale: run `make models`"
    bad = {t: kinds for t, kinds in rows.items() if any(k in matrix.DEFECTS for k in kinds)}
    assert not bad, f"the committed matrix has defects: {bad}"
