"""quarl's CUDA kernels compiled once per machine: NVRTC's binaries kept on disk.

Every ``.cu`` kernel (the w4a16 GEMMs, the fp8-cache decode attention) is compiled with NVRTC
when a process first needs it; a wgmma instantiation takes seconds, and an engine or a sweep
needs dozens. :func:`compile_kernel` does what ``torch.cuda._compile_kernel`` does (NVRTC to a
cubin, loaded with ``cuModuleLoadData``) and keeps the cubin in a directory, so that the next
process that asks for the same kernel loads it instead of compiling it again.

- The key is a SHA-256 over everything the binary depends on: the source text, the kernel
  name, the target architecture, the compiler options, and the toolchain (torch's version, its
  CUDA version and NVRTC's own). Any change compiles anew into another file.
- A file is one JSON header line (the mangled kernel name, the binary's size and SHA-256) and
  the binary. It is written to a temporary name and renamed into place, so a reader (another
  rank, a later run) sees a whole file or none; a file that does not check out (truncated,
  edited, another format) is compiled again and replaced.
- The directory is ``$QUARL_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/quarl/kernels``, else
  ``~/.cache/quarl/kernels``; ``QUARL_KERNEL_CACHE=off`` keeps nothing on disk. A directory that
  cannot be written warns once and the kernels are compiled as before.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from quarl.io import write_bytes_atomic

ENV = "QUARL_KERNEL_CACHE"
OFF = ("off", "0", "false", "none")
FORMAT = 1  # of a cache file; part of the key


def cache_dir() -> Path | None:
    """Where compiled kernels are kept (None: nowhere, ``QUARL_KERNEL_CACHE=off``)."""
    env = os.environ.get(ENV, "").strip()
    if env.lower() in OFF:
        return None
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "quarl" / "kernels"


@functools.lru_cache(maxsize=1)
def toolchain() -> str:
    """torch's version and CUDA version and NVRTC's own version (the compiler of the binaries)."""
    nvrtc = "unknown"
    try:
        from torch.cuda._utils import _get_nvrtc_library

        major, minor = ctypes.c_int(), ctypes.c_int()
        if _get_nvrtc_library().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)) == 0:
            nvrtc = f"{major.value}.{minor.value}"
    except Exception:  # (the key then leans on torch's CUDA version alone)
        pass
    return f"torch {torch.__version__} cuda {torch.version.cuda} nvrtc {nvrtc}"


def cache_key(source: str, name: str, arch: str, options: list[str], chain: str) -> str:
    text = json.dumps({"format": FORMAT, "source": source, "name": name, "arch": arch, "options": options,
                       "toolchain": chain}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def read_entry(path: Path) -> tuple[bytes, str] | None:
    """``(binary, mangled name)`` of a cache file, or None when it is missing or does not
    check out (its header's size and SHA-256 against the bytes after it)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    head, sep, binary = data.partition(b"\n")
    if not sep:
        return None
    try:
        meta = json.loads(head)
        ok = (meta.get("format") == FORMAT and meta["size"] == len(binary)
              and meta["sha256"] == hashlib.sha256(binary).hexdigest() and isinstance(meta["name"], str))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return (binary, meta["name"]) if ok else None


def write_entry(path: Path, binary: bytes, mangled: str) -> None:
    """The cache file of ``binary``, written under a temporary name in its directory and renamed
    into place (readers see all of it or nothing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    head = json.dumps({"format": FORMAT, "name": mangled, "size": len(binary),
                       "sha256": hashlib.sha256(binary).hexdigest()}).encode()
    write_bytes_atomic(path, head + b"\n" + binary)


_WARNED: set[str] = set()


def _warn_once(where: Path, err: Exception) -> None:
    if str(where) not in _WARNED:
        _WARNED.add(str(where))
        warnings.warn(f"compiled CUDA kernels cannot be kept in {where} ({type(err).__name__}: {err}); they are "
                      f"compiled in every process. Set {ENV}=DIR to a writable directory (or {ENV}=off)",
                      RuntimeWarning, stacklevel=3)


def _nvrtc(source: str, name: str, arch: str, options: list[str]) -> tuple[bytes, str]:
    from torch.cuda._utils import _nvrtc_compile

    return _nvrtc_compile(source, name, arch, None, options)


def _load(binary: bytes, mangled: str) -> Any:
    from torch.cuda._utils import _cuda_load_module

    return _cuda_load_module(binary, [mangled])[mangled]


def _device_arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"{major}{minor}"


def compile_kernel(source: str, name: str, compute_capability: str | None = None,
                   nvcc_options: list[str] | None = None, *, compile: Callable | None = None,
                   load: Callable | None = None, chain: str | None = None) -> Any:
    """``torch.cuda._compile_kernel(source, name, compute_capability, nvcc_options=...)``, with
    the binary read from or written to :func:`cache_dir` (``compile`` / ``load`` / ``chain``:
    NVRTC, the module loader and the toolchain, replaceable for tests)."""
    compile, load = compile or _nvrtc, load or _load
    arch = compute_capability or _device_arch()
    options = list(nvcc_options or [])
    where = cache_dir()
    path = None
    if where is not None:
        path = where / f"{cache_key(source, name, arch, options, chain or toolchain())}.cubin"
        hit = read_entry(path)
        if hit is not None:
            try:
                return load(*hit)
            except Exception:  # a binary this driver will not load: compile it again, below
                pass
    binary, mangled = compile(source, name, arch, options)
    if path is not None:
        try:
            write_entry(path, binary, mangled)
        except OSError as err:
            _warn_once(where, err)
    return load(binary, mangled)
