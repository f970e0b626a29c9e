"""The execution plan (``cbgen.model.plan``): every path chosen once, with its reason, logged in one
line at engine start, followed by the runner and the sampler, re-resolved when the model's structure
changes, and printed by ``cbgen info``."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from cbgen import LLM, SamplingParams
from cbgen.batch_invariant.native import parity_form
from cbgen.cli import main as cli_main
from cbgen.config import EngineConfig
from cbgen.model.backends import TorchBackend
from cbgen.model.cpu_fast import gemm_choice
from cbgen.model.cpu_fast.qualify import StructureWatch
from cbgen.model.kernels.cpu import decoder as cpu_decoder
from cbgen.model.kernels.cpu import ops as cpu_kernels
from cbgen.model.plan import decode_mode_choice, plan_for_model, resolve_plan
from oracle import compare, hf_greedy
from tiny_models import make_model, make_prompts

pytestmark = pytest.mark.native("c")

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


@pytest.fixture(autouse=True)
def gemm_cache(tmp_path, monkeypatch):
    """GEMM choices measured here go to a fresh directory, not the user's cache.  The C kernels
    are loaded first, so they are not rebuilt in it."""
    cpu_kernels.available()
    monkeypatch.setenv("CBGEN_KERNEL_DIR", str(tmp_path))
    monkeypatch.delenv("CBGEN_GEMM", raising=False)
    return tmp_path


def _plan(model, **settings):
    return plan_for_model(model, EngineConfig(**settings))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_llama_on_the_cpu(dtype) -> None:
    """Every choice for a tiny Llama on this CPU, with its reason; the GEMM choice is measured on
    the first resolve and read from the on-disk cache on the second."""
    model = make_model("llama", dtype=dtype)
    plan = _plan(model)
    name = str(dtype).removeprefix("torch.")
    assert (plan.device.type, plan.dtype) == ("cpu", dtype)
    assert (plan.attention, plan.forward, plan.decode_mode) == ("cpu", "fused", "eager")
    assert plan.attention_why == f"auto on the CPU: the C kernels, {name}"
    assert "LlamaForCausalLM on the allow list" in plan.forward_why
    found = gemm_choice.candidates(dtype)
    assert list(plan.gemms.names()) == list(gemm_choice.ROW_CLASSES)
    assert set(plan.gemms.names().values()) <= set(found)
    assert plan.gemms.source == "measured"
    # Every projection group of a 64-wide model is below the packing threshold: no C decode step.
    assert plan.c_step == frozenset() and "too small to pack" in plan.c_step_why
    assert (plan.greedy, plan.sampled_rows, plan.row_prefill_max) == ("c", "readback", 64)
    assert plan.greedy_kernel() is cpu_kernels.greedy_rows
    assert plan.watch_structure

    line = plan.describe()
    assert "\n" not in line and str(plan) == line
    assert line.startswith(f"LlamaForCausalLM on cpu, {name}: attention cpu (")
    for part in (
        "forward fused (",
        "GEMM single ",
        "C decode step none (",
        "decode mode eager (",
        "greedy C kernel (",
    ):
        assert part in line
    report = plan.report().splitlines()
    assert report[0] == f"execution plan for LlamaForCausalLM on cpu, {name}"
    labels = [
        row.split()[0] + (" " + row.split()[1] if row.split()[0] == "GEMM" else "") for row in report[1:]
    ]
    # "decode loops": the tests pin the widest (conftest); test_decode_loops.py covers the measurement.
    assert labels[:7] == [
        "attention",
        "decode",
        "forward",
        "cache",
        "GEMM single",
        "GEMM decode",
        "GEMM prefill",
    ]
    assert (
        f"cache {512 // (4 // plan.dtype.itemsize)} bytes of KV a token (kv, layers 0-1: 2 KV heads x K 16"
        in line
    )
    assert "decode loops widest (CBGEN_DECODE_LOOPS)" in line
    assert _plan(model).gemms.source == "cache"


def test_the_engine_resolves_logs_and_follows_one_plan(caplog) -> None:
    model = make_model("llama")
    with caplog.at_level(logging.INFO, logger="cbgen"):
        llm = LLM(model, block_size=8)
    logged = [r.getMessage() for r in caplog.records if "execution plan" in r.getMessage()]
    plan = llm.engine.plan
    assert logged == [f"cbgen: execution plan: {plan}"]
    runner = llm.engine.runner
    assert runner.plan is plan and runner.backend == plan.attention
    assert runner.fused is not None and runner.static is None
    assert llm.engine.input_builder.row_prefill_max == plan.row_prefill_max
    assert llm.engine.sampler.greedy_kernel is cpu_kernels.greedy_rows
    assert llm.engine.sampler.sync_free is False


@pytest.mark.parametrize("arch", ["gemma2", "phi3"])
def test_a_model_off_the_allow_list_gets_the_module_forward(arch) -> None:
    plan = _plan(make_model(arch))
    assert plan.forward == "module"
    assert plan.forward_why.endswith("is not on the fused path's allow list")
    assert plan.gemms is None and plan.c_step == frozenset()
    assert "GEMM" not in plan.describe() and "forward module (" in plan.describe()


def test_a_peft_wrapped_llama_gets_the_module_forward() -> None:
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    wrapped = get_peft_model(make_model("llama"), lora)
    assert _plan(wrapped).forward_why == "PeftModelForCausalLM is not on the fused path's allow list"
    # The same adapters injected into the Llama itself: its projections are no longer plain.
    plan = _plan(wrapped.get_base_model())
    assert plan.forward == "module" and "q_proj is Linear, not nn.Linear" in plan.forward_why


def test_settings_that_rule_out_the_fused_forward() -> None:
    model = make_model("llama")
    plan = _plan(model, attention_backend="torch")
    assert (plan.attention, plan.attention_why) == ("torch", "requested")
    assert plan.forward == "module" and "attends through the C backend, not torch" in plan.forward_why
    assert plan.row_prefill_max == 0 and not plan.watch_structure
    assert plan.greedy == "c"  # the sampler's kernel does not depend on the attention backend
    plan = _plan(model, fused_decode=False)
    assert (plan.forward, plan.forward_why) == ("module", "fused_decode=False")
    assert not plan.watch_structure


def test_decode_mode_with_compile() -> None:
    model = make_model("llama")
    plan = _plan(model, compile=True)
    assert plan.decode_mode == "static" and "compile" in plan.decode_mode_why and plan.compile
    assert plan.forward == "module" and plan.forward_why.startswith("decode_mode static")
    assert _plan(model, decode_mode="static").decode_mode_why == "requested"
    with pytest.raises(ValueError, match="compile=True"):
        _plan(model, compile=True, decode_mode="eager")
    with pytest.raises(ValueError, match="CUDA device"):
        _plan(model, decode_mode="graphs")
    cuda = torch.device("cuda")  # the choice itself; nothing runs there
    assert decode_mode_choice("auto", cuda, False, TorchBackend())[0] == "graphs"
    uncapturable = TorchBackend()
    uncapturable.cuda_graphs_ok = lambda device: False
    assert decode_mode_choice("auto", cuda, False, uncapturable)[0] == "eager"
    assert decode_mode_choice("auto", cuda, True, uncapturable)[0] == "static"


def test_greedy_kernel_decision(monkeypatch) -> None:
    """The C greedy kernel on the CPU for float32/bfloat16 logits where the kernels build; torch
    otherwise, with the reason.  The engine's sampler gets exactly the plan's kernel."""
    half = _plan(make_model("llama", dtype=torch.float16))
    assert half.greedy == "torch" and "not float16" in half.greedy_why
    assert half.greedy_kernel() is None and half.attention == "torch"
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    monkeypatch.setattr(cpu_kernels, "unavailable_reason", lambda: "no compiler here")
    plan = _plan(make_model("llama"), attention_backend="torch")
    assert plan.greedy == "torch" and "no compiler here" in plan.greedy_why
    llm = LLM(make_model("llama"), block_size=8, attention_backend="torch")
    assert llm.engine.plan.greedy == "torch" and llm.engine.sampler.greedy_kernel is None


@pytest.mark.native("avx2")  # the panel GEMM
def test_c_decode_step_per_row_class(monkeypatch) -> None:
    """The plan names the row classes whose decode steps run as one C call, from each class's GEMM;
    the fused forward calls the C step for exactly those."""
    model = make_model("llama", **WIDE)
    monkeypatch.setenv("CBGEN_GEMM", "panel")
    plan = _plan(model)
    assert plan.c_step == frozenset(gemm_choice.ROW_CLASSES) and plan.gemms.source == "CBGEN_GEMM"
    monkeypatch.setenv("CBGEN_GEMM", "single=panel,decode=plain,prefill=plain")
    plan = _plan(model)
    assert plan.c_step == frozenset({"single"})
    assert plan.c_step_why == "decode: plain has no C form; prefill: plain has no C form"

    rows = []
    original = cpu_decoder.decoder_step
    monkeypatch.setattr(
        cpu_decoder, "decoder_step", lambda *a, **k: rows.append(a[4].shape[0]) or original(*a, **k)
    )
    llm = LLM(model, block_size=8)
    assert llm.engine.plan.c_step == frozenset({"single"})
    prompts = make_prompts(3, lengths=(3, 20))
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 3, 10)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert rows and set(rows) == {1}  # the one-row steps only
    assert got[2] == hf_greedy(model, prompts[2], 10)


def test_the_amx_row_limit_is_a_plan_decision(monkeypatch) -> None:
    """A row class whose GEMM is AMX runs the one-call C step only when no decode step can have more
    rows than the AMX kernel takes (max_num_seqs); the step itself no longer checks."""
    from types import SimpleNamespace

    from cbgen.model.cpu_fast import fused_forward

    model = make_model("llama", **WIDE)
    monkeypatch.setattr(fused_forward, "_c_step_gemm_reason", lambda modules, gemm: None)
    amx = SimpleNamespace(for_class=lambda name: SimpleNamespace(name="amx"))
    classes, _ = fused_forward.c_step_classes(model, amx, max_rows=256)
    assert classes == frozenset(gemm_choice.ROW_CLASSES)
    classes, why = fused_forward.c_step_classes(model, amx, max_rows=gemm_choice.AMX_MAX_ROWS + 1)
    assert classes == frozenset() and f"AMX kernel's {gemm_choice.AMX_MAX_ROWS} rows" in why


def test_a_hook_re_resolves_the_plan_before_the_step(caplog) -> None:
    """A hook reaches no weight fingerprint: the guard before each step re-resolves the plan (logged),
    the step runs the module forward, and removing the hook brings the fused forward back."""
    model = make_model("llama")
    prompts = make_prompts(3, lengths=(5, 30))
    llm = LLM(model, block_size=8)
    assert llm.engine.plan.forward == "fused"
    seen = []
    handle = model.model.layers[0].mlp.register_forward_hook(lambda m, i, o: seen.append(1))
    try:
        with caplog.at_level(logging.INFO, logger="cbgen"):
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        handle.remove()
    plan = llm.engine.plan
    assert (plan.forward, plan.forward_why) == ("module", "forward hooks are registered")
    assert llm.engine.runner.fused is None and seen
    replans = [r.getMessage() for r in caplog.records if "re-resolved" in r.getMessage()]
    assert len(replans) == 1 and replans[0].endswith(str(plan))
    compare(model, prompts, got, [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts])
    llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.plan.forward == "fused" and llm.engine.runner.fused is not None


def test_a_weight_change_that_changes_the_structure_re_resolves_the_plan() -> None:
    """A weight replaced by a non-contiguous tensor is a weight change (new storage): the engine's
    weight check re-resolves the plan before any step runs.  A change of values only (an optimizer
    step) keeps the plan."""
    model = make_model("llama")
    llm = LLM(model, block_size=8)
    before = llm.engine.plan
    up = model.model.layers[0].mlp.up_proj
    with torch.no_grad():
        up.weight.mul_(1.5)
    llm.engine.check_weights()
    assert llm.engine.plan is before and llm.engine.weights.version == 1
    up.weight.data = up.weight.data.t().contiguous().t()
    llm.engine.check_weights()
    assert llm.engine.weights.version == 2
    plan = llm.engine.plan
    assert (plan.forward, plan.forward_why) == ("module", "some weights are not contiguous")
    assert llm.engine.runner.fused is None
    prompts = make_prompts(2, lengths=(5, 20))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    compare(model, prompts, got, [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts])
    up.weight.data = up.weight.data.contiguous()
    llm.engine.check_weights()
    assert llm.engine.plan.forward == "fused"


def test_an_injected_adapter_re_resolves_the_plan_before_the_step() -> None:
    """PEFT injecting adapters in place wraps the projections around the same parameters: the guard
    before the step re-resolves the plan, and the step runs the module forward exactly."""
    from peft import LoraConfig, inject_adapter_in_model

    model = make_model("llama")
    llm = LLM(model, block_size=8)
    torch.manual_seed(0)  # init_lora_weights=False draws random A and B: the adapter changes outputs
    inject_adapter_in_model(LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False), model)
    prompts = make_prompts(2, lengths=(5, 20))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    plan = llm.engine.plan
    assert plan.forward == "module" and "q_proj is Linear, not nn.Linear" in plan.forward_why
    compare(model, prompts, got, [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts])


def test_a_swapped_module_with_the_same_weights_re_resolves() -> None:
    model = make_model("llama")
    llm = LLM(model, block_size=8)
    attn = model.model.layers[1].self_attn
    wrapped = type("Wrapped", (nn.Linear,), {})(attn.v_proj.in_features, attn.v_proj.out_features, bias=False)
    wrapped.weight = attn.v_proj.weight
    attn.v_proj = wrapped
    llm.engine.check_weights()  # the same parameters: no weight change to see
    assert llm.engine.plan.forward == "fused"
    llm.generate(make_prompts(1), SamplingParams(max_tokens=2), use_tqdm=False)
    assert "v_proj is Wrapped, not nn.Linear" in llm.engine.plan.forward_why


def test_the_structure_watch_fires_once_per_change() -> None:
    """Values changing in place are not a structural change; a hook (on a module or global), a
    swapped or moved child, a new parameter or new weight storage is, once."""
    model = make_model("llama")
    watch = StructureWatch(model)
    assert not watch.changed()
    with torch.no_grad():
        model.lm_head.weight.mul_(2)
    assert not watch.changed()
    handle = model.model.norm.register_forward_pre_hook(lambda m, a: None)
    assert watch.changed() and not watch.changed()
    handle.remove()
    assert watch.changed() and not watch.changed()
    model.lm_head.weight.data = model.lm_head.weight.data.clone()
    assert watch.changed() and not watch.changed()
    model.model.layers[0].mlp.act_fn = nn.SiLU()
    assert watch.changed() and not watch.changed()
    # Two weights trading storage: every pointer is still there (a sum or XOR of them would not move).
    attn = model.model.layers[0].self_attn
    attn.q_proj.weight.data, attn.o_proj.weight.data = attn.o_proj.weight.data, attn.q_proj.weight.data
    assert watch.changed() and not watch.changed()
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach())  # a new parameter, same storage
    assert watch.changed() and not watch.changed()
    # A child moved from one parent to another.
    layers = model.model.layers
    layers[1].add_module("extra", layers[0].mlp.act_fn)
    del layers[0].mlp.act_fn
    assert watch.changed() and not watch.changed()
    handle = nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    try:
        assert watch.changed() and not watch.changed()
    finally:
        handle.remove()
    assert watch.changed() and not watch.changed()


def test_resolving_again_keeps_the_gemm_choice() -> None:
    from cbgen.model.plan import resolve_again

    model = make_model("llama")
    plan = resolve_plan(model, EngineConfig(), "cpu", torch.float32)
    again = resolve_again(plan, model)
    assert again.gemms is plan.gemms and again.describe() == plan.describe()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cbgen_info_prints_the_plan(tmp_path, capsys, dtype) -> None:
    folder = tmp_path / "tiny"
    make_model("llama").save_pretrained(folder)
    cli_main(["info", str(folder), "--dtype", dtype])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"execution plan for LlamaForCausalLM on cpu, {dtype}"
    rows = {line.split()[0]: line.split()[1] for line in out[1:]}
    assert rows["attention"] == "cpu" and rows["forward"] == "fused" and rows["greedy"] == "C"
    cli_main(["info", str(folder), "--attention-backend", "torch"])
    out = capsys.readouterr().out
    assert "  forward        module" in out and "GEMM" not in out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_parity_plan(dtype) -> None:
    """batch_invariant=True: the parity attention, the torch sampler, no short prefill rows, eager or
    static decode steps; the direct forward for a model the fused path qualifies (on the C parity
    kernels, eager steps), with the structure watched, else the module forward."""
    model = make_model("llama", dtype=dtype)
    plan = _plan(model, batch_invariant=True)
    c_kernels = parity_form(torch.device("cpu"), dtype) == "c"
    forward = "direct" if c_kernels else "module"
    assert plan.parity and (plan.attention, plan.forward) == ("parity", forward)
    # The C greedy kernel where it builds: an exact argmax; the logprobs are recomputed the trainer's way.
    assert plan.greedy == _plan(model).greedy
    assert (plan.decode_mode, plan.row_prefill_max, plan.gemms, plan.watch_structure) == (
        "eager",
        0,
        None,
        c_kernels,
    )
    assert plan.describe().startswith(f"LlamaForCausalLM on cpu, {str(dtype).removeprefix('torch.')}: parity")
    static = _plan(model, batch_invariant=True, decode_mode="static")
    assert (static.decode_mode, static.forward) == ("static", "module")
    assert _plan(make_model("phi3", dtype=dtype), batch_invariant=True).forward == "module"
    assert not _plan(model).parity
    with pytest.raises(ValueError, match="graphs"):
        _plan(model, batch_invariant=True, decode_mode="graphs")
    with pytest.raises(ValueError, match="compile"):
        _plan(model, batch_invariant=True, compile=True)


@pytest.mark.native("avx2")
def test_cbgen_info_prints_the_parity_plan(tmp_path, capsys) -> None:
    folder = tmp_path / "tiny"
    make_model("qwen3").save_pretrained(folder)
    cli_main(["info", str(folder), "--batch-invariant"])
    rows = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()[1:]}
    assert (
        rows["parity"] == "batch-invariant" and rows["attention"] == "parity" and rows["forward"] == "direct"
    )
