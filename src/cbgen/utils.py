"""Small shared helpers: logging, byte formatting, device and dtype resolution, huge-page advice."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import sys

import torch

from cbgen import envs

_PACKAGE_LOGGER = "cbgen"
_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_handler_installed = False


def get_logger(name: str) -> logging.Logger:
    """Return a logger under the ``cbgen`` hierarchy.

    The first call gives the ``cbgen`` logger one stderr handler, at the level named by
    ``$CBGEN_LOG_LEVEL`` (default INFO), so that progress such as model conversion is visible
    without the application configuring logging.  Records still propagate to the root logger,
    which keeps pytest's ``caplog`` and application-level handlers working.
    """
    global _handler_installed
    if not _handler_installed:
        pkg = logging.getLogger(_PACKAGE_LOGGER)
        if not pkg.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter(_LOG_FORMAT, datefmt="%H:%M:%S"))
            pkg.addHandler(handler)
            level = (envs.get("CBGEN_LOG_LEVEL") or "INFO").upper()
            pkg.setLevel(getattr(logging, level, logging.INFO))
        _handler_installed = True
    if name != _PACKAGE_LOGGER and not name.startswith(_PACKAGE_LOGGER + "."):
        name = f"{_PACKAGE_LOGGER}.{name}"
    return logging.getLogger(name)


def human_bytes(n: float) -> str:
    """Format a byte count with binary units, e.g. ``human_bytes(1536) == "1.50 KiB"``."""
    if n < 0:
        return "-" + human_bytes(-n)
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
    value = float(n)
    for unit in units:
        if value < 1024 or unit == units[-1]:
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """Turn a user's device choice into a ``torch.device``.

    ``None`` or ``"auto"`` picks CUDA when it is available, else the CPU.  An explicit CUDA device
    on a machine without CUDA is an error here rather than a confusing failure at first use.
    """
    if device is None or (isinstance(device, str) and device.strip().lower() == "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device.strip() if isinstance(device, str) else device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"unknown device {device!r}: expected 'cpu', 'cuda', 'cuda:N' or 'auto'") from err
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available on this machine")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {device!r} requested but only {torch.cuda.device_count()} CUDA device(s) exist"
            )
    return resolved


_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _parse_dtype(value: str | torch.dtype, what: str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        dtype = value
    elif isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        if key not in _DTYPE_NAMES:
            raise ValueError(
                f"unknown {what} {value!r}: expected 'auto', 'float32'/'fp32', 'bfloat16'/'bf16', "
                f"'float16'/'fp16' or a torch.dtype"
            )
        dtype = _DTYPE_NAMES[key]
    else:
        raise ValueError(f"{what} must be a string or torch.dtype, got {type(value).__name__}")
    if dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"unsupported {what} {dtype}: use float32, bfloat16 or float16")
    return dtype


def resolve_dtype(
    dtype: str | torch.dtype,
    config_dtype: str | torch.dtype | None,
    device: str | torch.device,
) -> torch.dtype:
    """Pick the compute dtype for a model.

    ``"auto"`` means the checkpoint's own dtype (``config_dtype``; float32 when unknown), except
    that float16 on CPU becomes float32, because CPU float16 kernels are slow and some are missing.
    An explicit dtype is always honoured.  Anything unrecognised raises ``ValueError``.
    """
    if isinstance(dtype, str) and dtype.strip().lower() == "auto":
        if config_dtype is None:
            chosen = torch.float32
        else:
            try:
                chosen = _parse_dtype(config_dtype, "checkpoint dtype")
            except ValueError:
                # A checkpoint stored in e.g. float64 or int8 still loads fine in float32.
                chosen = torch.float32
        if chosen == torch.float16 and torch.device(device).type == "cpu":
            chosen = torch.float32
        return chosen
    return _parse_dtype(dtype, "dtype")


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


@functools.cache
def _libc() -> ctypes.CDLL:
    # One handle for the process: every CDLL object is a small reference cycle of its own.
    return ctypes.CDLL(None)


def advise_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """Advises the kernel to back ``t``'s not yet touched pages with transparent huge pages (Linux
    CPU tensors; elsewhere, or where refused, nothing happens).  Call it before the first write.

    Why: large tensors read in scattered blocks (the KV cache) or as long streams (packed weights)
    cost a TLB miss every 4 KiB on small pages; attention over a 1 GiB cache ran ~10% faster on
    2 MiB pages."""
    if t.device.type != "cpu" or not sys.platform.startswith("linux"):
        return t
    start = t.data_ptr()
    lo = (start + _HUGE_PAGE - 1) & ~(_HUGE_PAGE - 1)
    hi = (start + t.numel() * t.element_size()) & ~(_HUGE_PAGE - 1)
    if hi > lo:
        # Advice only: without it everything works the same on small pages.
        with contextlib.suppress(OSError, AttributeError):
            _libc().madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_HUGEPAGE)
    return t
