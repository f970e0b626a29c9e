"""The weight watcher sees PEFT adapter changes that alter the forward without touching a watched
tensor: a LoRA scale (``scaling[...] = x``, ``set_scale``, ``scale_layer``), a merge, the active
adapters, ``disable_adapter()``, input casting.  After each, the next ``generate`` must equal a fresh
engine's and ``generate()`` of the changed model (no K/V of the old forward served from the prefix
cache), and ``weight_version`` must count the change."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from cbgen import LLM, SamplingParams
from cbgen.model.loading.weights import WeightWatcher
from extras import require_extra
from oracle import compare, hf_greedy
from tiny_models import make_model, make_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

require_extra("peft")

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _lora_config(seed: int):
    from peft import LoraConfig

    torch.manual_seed(seed)  # init_lora_weights=False draws random A and B: the adapter matters
    return LoraConfig(
        r=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False, task_type="CAUSAL_LM"
    )


def _peft_model():
    from peft import get_peft_model

    model = get_peft_model(make_model("llama", seed=0), _lora_config(seed=1)).eval()
    model.add_adapter("other", _lora_config(seed=2))
    return model


def _lora_layers(model) -> list:
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _zero_scaling(model) -> None:
    for m in _lora_layers(model):
        m.scaling["default"] = 0.0  # what PEFT's own scale helpers write


def _set_scale(model) -> None:
    for m in _lora_layers(model):
        m.set_scale("default", 0.5)


def _scale_layer(model) -> None:
    for m in _lora_layers(model):
        m.scale_layer(3.0)


def _merge(model) -> None:
    model.merge_adapter()  # writes the base weights through .data: no version counter moves


SCALE_CHANGES: dict[str, Callable] = {
    "scaling-dict": _zero_scaling,
    "set_scale": _set_scale,
    "scale_layer": _scale_layer,
    "merge": _merge,
}


@pytest.mark.parametrize("change", list(SCALE_CHANGES))
def test_adapter_change_reaches_the_next_generate(change):
    model = _peft_model()
    prompts = make_prompts(4, lengths=(17, 40), seed=5)
    llm = LLM(model, block_size=8, num_blocks=64)
    adapted = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))  # the second run is served from the cache
    hits, resets = llm.stats.prefix_cache_hits, llm.stats.prefix_cache_resets
    assert hits > 0, "setup: the prefix cache must hold the prompts, or stale K/V could not show"

    SCALE_CHANGES[change](model)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    got = _tokens(outs)
    assert llm.weight_version == 1 and all(o.weight_version == 1 for o in outs)
    assert llm.stats.prefix_cache_resets == resets + 1 and llm.stats.prefix_cache_hits == hits
    fresh = _tokens(LLM(model, block_size=8, num_blocks=64).generate(prompts, GREEDY, use_tqdm=False))
    assert got == fresh
    compare(model, prompts, got, [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts])
    if change != "merge":  # a merge keeps the forward (up to rounding): only the cache must go
        assert got != adapted, "setup: the change should change the output"
    if change == "scaling-dict":  # a zero scale is the base model, exactly
        base = make_model("llama", seed=0)
        compare(base, prompts, got, [hf_greedy(base, p, GREEDY.max_tokens) for p in prompts])


def test_scale_back_and_unmerge_are_changes_too():
    model = _peft_model()
    prompts = make_prompts(3, lengths=(17, 30), seed=6)
    llm = LLM(model, block_size=8, num_blocks=64)
    adapted = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    layers = _lora_layers(model)
    for m in layers:
        m.scale_layer(0.0)
    llm.generate(prompts, GREEDY, use_tqdm=False)
    for m in layers:
        m.unscale_layer()  # back to lora_alpha / r: the adapter's own output again
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == adapted
    model.merge_adapter()
    llm.generate(prompts, GREEDY, use_tqdm=False)
    model.unmerge_adapter()
    got = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert llm.weight_version == 4
    compare(model, prompts, got, [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts])


def _set_both_active(model) -> None:
    for m in _lora_layers(model):
        m.set_adapter(["default", "other"])


def _enter(context):
    context.__enter__()
    return context  # held by the test: a collected context manager would leave its block


def _no_input_cast(model) -> None:
    for m in _lora_layers(model):
        m.cast_input_dtype_enabled = False


STATE_CHANGES: dict[str, Callable] = {
    "scaling-dict": _zero_scaling,
    "set_scale": _set_scale,
    "scale_layer": _scale_layer,
    "merge": _merge,
    "set_adapter": lambda model: model.set_adapter("other"),
    "two-active": _set_both_active,
    "disable_adapter": lambda model: _enter(model.disable_adapter()),
    "input-cast": _no_input_cast,
}


@pytest.mark.parametrize("change", list(STATE_CHANGES))
def test_each_adapter_state_is_in_the_fingerprint(change):
    model = _peft_model()
    watcher = WeightWatcher(model)
    assert not watcher.changed()
    held = STATE_CHANGES[change](model)  # noqa: F841 (an entered context stays entered)
    assert watcher.changed() and watcher.version == 1
    assert not watcher.changed(), "a change is reported once"


def test_a_list_mutated_in_place_is_seen():
    # PEFT's wrappers append to the list they hold: a fingerprint that kept the list would miss it.
    model = _peft_model()
    _set_both_active(model)
    watcher = WeightWatcher(model)
    for m in _lora_layers(model):
        m._active_adapter.remove("other")
    assert watcher.changed()


def test_what_leaves_the_forward_alone_is_not_a_change():
    model = _peft_model()
    watcher = WeightWatcher(model)
    model.train()
    model.eval()
    for m in _lora_layers(model):
        m.set_scale("default", 1.0)  # the scale it already has
        m.lora_dropout["default"].p = 0.5  # dropout runs in training only
    model.set_adapter("default")  # already active
    assert not watcher.changed() and watcher.version == 0
