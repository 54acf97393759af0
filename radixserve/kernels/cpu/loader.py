"""Build and load radixserve's C++ CPU kernels, one variant per CPU instruction set.

    csrc/ops.cpp               every op's schema (torch.ops.radixserve_cpu.<name>)
    csrc/paged_attention.cpp   paged_attention, paged_attention_varlen
    csrc/flash_attention.cpp   extend_attention (tiled, online softmax: PREFILL / EXTEND)
    csrc/decoder_glue.cpp      fused_add_rms_norm_, rope_, silu_and_mul, gelu_tanh_and_mul
    csrc/quant_linear.cpp      quant_linear (Q8_0 / Q4_1 weights x block-quantised int8 activations)
    csrc/decode_stack.cpp      DecodeStack: the whole decoder stack of a DECODE step in one call
    csrc/lora_sgmv.cpp         lora_sgmv (each row's own LoRA adapter delta on one projection)
    csrc/fused_experts.cpp     fused_experts (a MoE layer's routed experts on their stacked low-bit blocks)
    csrc/repack.cpp            repack_kquant / repack_legacy (a GGUF Q4_K / Q6_K, Q4_0 / Q4_1 / Q8_0 tensor's
                               blocks into quant_linear's layout;
                               _m16: a stack mixing the two, into their join Q8_M16)
    csrc/*.h                   C++ interfaces shared between the families (ops.h, quant_linear.h), and
                               quant_tiles.h: the quantised GEMM's register tiles (quant_linear.cpp);
                               quant_amx.h: its AMX-INT8 tiles for 16 rows at a time (the amx variant)

The variant is chosen at run time from what *this* CPU reports (/proc/cpuinfo flags), never from
what the build machine had: `amx` (avx512vnni's, plus AMX-INT8 tiles for the long steps' quantised GEMMs),
`avx512vnni` (AVX-512 F/BW/VL/DQ + VNNI: the integer dot products of the low-bit kernels in one instruction), `avx512` (AVX-512 F/BW/VL/DQ), `avx2` (AVX2 + FMA) or `generic`
(the portable C++ loops, no vector extensions beyond the x86-64 baseline). RADIXSERVE_CPU_ISA
forces a variant the CPU supports (the tests run the lower ones that way; asking for one the CPU
lacks is a ValueError naming the missing features). Each variant is compiled with explicit
`-m` flags, not `-march=native`, into its own cache folder keyed by ISA, CPU model and torch version
(~/.cache/radixserve/kernels/...), so a home folder shared by different machines never loads a
library built for another CPU. First build ~30-60 s on two cores; later processes load it in ~1 s.

A machine without a C++ compiler gets (None, reason) from load_cpu_ops() and the caller falls back
to plain PyTorch (ModelRunner logs it; --enable-deterministic-inference refuses to start).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

logger = logging.getLogger(__name__)

ISA_ENV = "RADIXSERVE_CPU_ISA"
_CSRC = os.path.join(os.path.dirname(__file__), "csrc")
SOURCES = [os.path.join(_CSRC, f) for f in ("ops.cpp", "paged_attention.cpp", "flash_attention.cpp",
                                                  "decoder_glue.cpp", "quant_linear.cpp", "decode_stack.cpp",
                                                  "lora_sgmv.cpp", "fused_experts.cpp", "repack.cpp")]

HEADERS = sorted(os.path.join(_CSRC, f) for f in os.listdir(_CSRC) if f.endswith(".h"))

_VNNI_NEEDS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx2", "fma", "f16c"})
_VNNI_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx2", "-mfma",
               "-mf16c"]
# best first: (name, CPU flags it needs, compiler flags)
ISAS: list[tuple[str, frozenset[str], list[str]]] = [
    # avx512vnni plus AMX-INT8 tiles for the quantised GEMM's long steps (csrc/quant_amx.h)
    ("amx", _VNNI_NEEDS | {"amx_tile", "amx_int8"}, [*_VNNI_FLAGS, "-mamx-tile", "-mamx-int8"]),
    ("avx512vnni", _VNNI_NEEDS, _VNNI_FLAGS),
    ("avx512", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"}),
     ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"]),
    ("avx2", frozenset({"avx2", "fma", "f16c"}), ["-mavx2", "-mfma", "-mf16c"]),
    ("generic", frozenset(), []),
]
ISA_NAMES = [name for name, _, _ in ISAS]


@functools.lru_cache(maxsize=1)
def cpu_info() -> tuple[frozenset[str], str]:
    """(feature flags, model name) of this CPU, from /proc/cpuinfo (empty where it does not exist)."""
    flags: set[str] = set()
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "flags" and not flags:
                    flags = set(value.split())
                elif key == "model name" and model == "unknown":
                    model = value.strip()
    except OSError:
        pass
    return frozenset(flags), model


# CPU flags that make bf16 matmul native (oneDNN's AMX brgemm, or AVX512-BF16 dot products)
BF16_MATMUL_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


def native_bf16_matmul(flags: frozenset[str] | None = None) -> bool:
    """Whether this CPU (or a CPU with `flags`) runs bf16 matmul natively: what --dtype auto asks."""
    return bool((cpu_info()[0] if flags is None else flags) & BF16_MATMUL_FLAGS)


def missing_features(isa: str) -> list[str]:
    needs = next(n for name, n, _ in ISAS if name == isa)
    return sorted(needs - cpu_info()[0])


def detect_isa() -> str:
    """The best variant this CPU runs."""
    return next(name for name, _, _ in ISAS if not missing_features(name))


def selected_isa() -> str:
    """RADIXSERVE_CPU_ISA if set (validated against this CPU), else the best variant it runs."""
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    if not forced:
        return detect_isa()
    if forced not in ISA_NAMES:
        raise ValueError(f"{ISA_ENV}={forced!r}: must be one of {', '.join(ISA_NAMES)}")
    missing = missing_features(forced)
    if missing:
        raise ValueError(f"{ISA_ENV}={forced}: this CPU lacks {', '.join(missing)}")
    return forced


def build_dir(isa: str) -> str:
    """One cache folder per (ISA, CPU model, torch version, sources and their folder): never a library
    from another machine, and two checkouts never rebuild over each other."""
    # the sources' folder too: the build files name absolute paths, so two checkouts with the same
    # sources would otherwise rebuild over each other's folder
    h = hashlib.sha1(f"{cpu_info()[1]}|{torch.__version__}|{os.path.realpath(_CSRC)}".encode())
    for path in SOURCES + HEADERS:
        with open(path, "rb") as f:
            h.update(f.read())
    key = h.hexdigest()[:10]
    root = os.environ.get("RADIXSERVE_KERNEL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                       "radixserve", "kernels")
    return os.path.join(root, f"{isa}-{key}")


@functools.lru_cache(maxsize=1)
def _build() -> tuple[Any | None, str, str]:
    """(ops, reason, isa), logged once. One variant per process: every variant registers torch.ops.radixserve_cpu."""
    ops, reason, isa = _build_variant()
    if ops is None:
        logger.warning("C++ CPU kernels unavailable, using the PyTorch paths: %s", reason.splitlines()[0][:300])
    else:
        logger.info("C++ CPU kernels: %s variant", isa)
    return ops, reason, isa


def _build_variant() -> tuple[Any | None, str, str]:
    try:
        isa = selected_isa()
    except ValueError as e:
        return None, str(e), ""
    # a variant picked from the CPU's flags that this compiler cannot build (amx needs GCC >= 11) falls back
    # to the next one the CPU runs; a forced one is that one or nothing
    forced = bool(os.environ.get(ISA_ENV, "").strip())
    candidates = [isa] if forced else [n for n in ISA_NAMES[ISA_NAMES.index(isa):] if not missing_features(n)]
    reason = ""
    for name in candidates:
        flags = next(f for n, _, f in ISAS if n == name)
        folder = build_dir(name)
        # `c++ --version` runs only where a mark is there to read (or, below, to write): most starts have neither
        marked = not forced and os.path.exists(os.path.join(folder, _FAILED))
        failed = _failed_before(folder, _compiler_id()) if marked else None
        if failed is not None:  # this compiler failed these sources before: a minute of compiling saved a start
            reason = reason or failed
            continue
        try:
            from torch.utils import cpp_extension  # lazy: torch's build helpers, only when kernels are built

            os.makedirs(folder, exist_ok=True)
            with _build_lock(folder):
                _load(cpp_extension, name, flags, folder)
            if forced and os.path.exists(os.path.join(folder, _FAILED)):  # built after all: trust it again
                os.remove(os.path.join(folder, _FAILED))
            if reason:
                logger.warning("C++ CPU kernels: the %s variant did not build (%s); using %s", isa,
                               reason.splitlines()[0][:200], name)
            return torch.ops.radixserve_cpu, "", name
        except Exception as exc:  # noqa: BLE001  # no compiler, no ninja, a failed build: all mean "fall back"
            why = f"{type(exc).__name__}: {exc}"
            reason = reason or why  # without a compiler each try fails at once
            if not forced:
                _remember_failure(folder, _compiler_id(), why)
    return None, reason, isa


_FAILED = ".radixserve-build-failed"  # in a variant's build folder: "<compiler id>\n<reason>"


def _compiler_id() -> str:
    """The C++ compiler's version line ("" without one): a failed build is remembered for that compiler only, so
    a new compiler (or one installed since) tries again."""
    try:
        out = subprocess.run([os.environ.get("CXX", "c++"), "--version"], check=False, capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.splitlines()[0].strip() if out.strip() else ""


def _failed_before(folder: str, compiler: str) -> str | None:
    """The reason this compiler could not build the variant in `folder` (its sources and torch), if it tried."""
    try:
        with open(os.path.join(folder, _FAILED), encoding="utf-8") as f:
            who, _, why = f.read(8192).partition("\n")
    except (OSError, UnicodeDecodeError):  # unreadable or garbage: as if absent (a build just tries again)
        return None
    return f"{why} (remembered in {folder}; {ISA_ENV}=<variant> forces a rebuild)" if who == compiler else None


def _remember_failure(folder: str, compiler: str, why: str) -> None:
    try:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, _FAILED), "w") as f:
            f.write(f"{compiler}\n{why[:4000]}")
    except OSError:
        pass  # a read-only cache: the next start tries again, as before


@contextmanager
def _build_lock(folder: str) -> Iterator[None]:
    """Serialise builders with an OS lock (released even if its holder is killed). torch's own
    baton is a plain file that a killed build leaves behind, after which every later process would
    wait forever; whoever holds this lock is the only builder, so a baton it finds is stale."""
    with open(os.path.join(folder, ".radixserve-build.lock"), "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            stale = os.path.join(folder, "lock")
            if os.path.exists(stale):
                logger.warning("removing a stale kernel build lock left by a killed build: %s", stale)
                os.remove(stale)
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _load(cpp_extension: Any, isa: str, flags: list[str], folder: str) -> None:
    cpp_extension.load(
        name=f"radixserve_cpu_{isa}",
        sources=SOURCES,
        # -ffast-math: lets GCC vectorise the softmax's expf (libmvec); the kernels have no inf/NaN logic.
        extra_cflags=["-O3", *flags, "-fopenmp", "-ffast-math"],
        extra_ldflags=["-fopenmp"],
        build_directory=folder,
        is_python_module=False,
        verbose=False,
    )


def loaded_isa() -> str | None:
    """The variant this process loaded (None if none could be)."""
    ops, _, isa = _build()
    return isa if ops is not None else None


def load_cpu_ops() -> tuple[Any | None, str]:
    """(torch.ops.radixserve_cpu, "") once built or loaded; (None, reason) when this machine cannot."""
    ops, reason, _ = _build()
    return ops, reason


def load_paged_attention() -> tuple[Callable[..., None] | None, str]:
    """(the paged attention kernel, "") or (None, reason)."""
    ops, reason = load_cpu_ops()
    return (None if ops is None else ops.paged_attention), reason


def main(argv: list[str] | None = None) -> None:
    """`python -m radixserve.kernels.cpu [--every-variant]`: build (or load) the kernels now, e.g. from `make
    setup`, so the first server start does not pay for the compile. `--every-variant` also builds each other
    variant this CPU can run (one process per variant: each registers the same ops), which the kernel tests load
    (tests/layers/test_kernel_isa.py). Never fails set-up."""
    args = sys.argv[1:] if argv is None else argv
    if args not in ([], ["--every-variant"]):
        raise SystemExit("usage: python -m radixserve.kernels.cpu [--every-variant]")
    built, why = load_cpu_ops()
    status = f"ready ({loaded_isa()} variant)" if built is not None else f"unavailable ({why.splitlines()[0][:200]})"
    print("radixserve C++ CPU kernels:", status)
    if args and built is not None:
        for isa in ISA_NAMES:
            if isa != loaded_isa() and not missing_features(isa):
                res = subprocess.run([sys.executable, "-m", "radixserve.kernels.cpu"], env={**os.environ, ISA_ENV: isa},
                                     capture_output=True, text=True)
                print(f"radixserve C++ CPU kernels, {isa} variant:",
                      res.stdout.strip().split(": ", 1)[-1] if res.returncode == 0 else "failed")
