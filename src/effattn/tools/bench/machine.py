"""What machine measured a benchmark: CPU model, vector extensions, threads, software versions.

Timings only mean something next to the machine that produced them: the same bf16 matmul runs at
about 860 GFLOP/s on a core with AVX-512 BF16 and about 1 GFLOP/s on one with AVX2 only. On
Linux the model and the extensions come from ``/proc/cpuinfo`` ("model name" and "flags" on x86,
"Features" on ARM); elsewhere from ``sysctl`` (macOS) or :func:`platform.processor`, with torch's
detected CPU capability (``torch.backends.cpu.get_cpu_capability()``, e.g. "AVX512") as the
extensions' fallback. The measured matmul peaks are added by the sweep
(:func:`effattn.tools.bench.speed.probe_machine`), which measures them in a worker process.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

# /proc/cpuinfo flag -> name, in the order they are reported. The ones that decide matmul speed:
# AVX2 (fp32 FMA), AVX-512 F (512-bit fp32), AVX-512 BF16 / AMX (native bf16 dot products;
# without them bf16 matmuls are emulated, about 1 GFLOP/s), and ARM's NEON/SVE/BF16.
EXTENSIONS = (
    ("avx2", "AVX2"),
    ("avx512f", "AVX-512 F"),
    ("avx512_bf16", "AVX-512 BF16"),
    ("amx_tile", "AMX"),
    ("amx_bf16", "AMX BF16"),
    ("asimd", "NEON"),
    ("sve", "SVE"),
    ("sve2", "SVE2"),
    ("bf16", "BF16"),
)
_CPUINFO = Path("/proc/cpuinfo")


def parse_cpuinfo(text: str) -> tuple[str | None, list[str]]:
    """The CPU model and vector extensions named in ``/proc/cpuinfo`` text (its first processor).

    The model is "model name" (x86) or "Model"/"Hardware" (ARM boards); the extensions are the
    known names (:data:`EXTENSIONS`) among "flags" (x86) or "Features" (ARM).
    """
    model: str | None = None
    flags: set[str] = set()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip().lower(), value.strip()
        if key in ("model name", "model", "hardware") and model is None and value:
            if not value.isdigit():  # x86's "model" is a number; ARM boards' is a name
                model = value
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
    return model, [name for flag, name in EXTENSIONS if flag in flags]


def _sysctl(name: str) -> str | None:
    try:
        res = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if res.returncode != 0:
        return None
    return res.stdout.strip() or None


def cpu_model_and_extensions() -> tuple[str | None, list[str]]:
    """This machine's CPU model and vector extensions (see :func:`parse_cpuinfo`), falling back
    to ``sysctl`` / :func:`platform.processor` and torch's CPU capability off Linux."""
    try:
        model, extensions = parse_cpuinfo(_CPUINFO.read_text())
    except OSError:
        model, extensions = None, []
    if model is None and sys.platform == "darwin":
        model = _sysctl("machdep.cpu.brand_string")
    model = model or platform.processor() or None
    if not extensions:
        capability = torch.backends.cpu.get_cpu_capability()
        extensions = [capability] if capability not in ("DEFAULT", "NO AVX") else []
    return model, extensions


def gpu_info(device: torch.device | str) -> dict[str, Any]:
    """Name, compute capability, memory and multiprocessors of the CUDA ``device``, and the CUDA
    version torch was built with."""
    props = torch.cuda.get_device_properties(device)
    return {"name": props.name, "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1),
            "multiprocessors": props.multi_processor_count, "cuda": torch.version.cuda}


def machine_info(device: torch.device | str = "cpu") -> dict[str, Any]:
    """The machine and software of a measurement (the ``machine`` entry of every summary); with
    a CUDA ``device``, its GPU too (:func:`gpu_info`, under ``"gpu"``)."""
    model, extensions = cpu_model_and_extensions()
    info = {"cpu_model": model, "vector_extensions": extensions,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "platform": platform.platform(), "processor": platform.processor(),
            "python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if torch.device(device).type == "cuda":
        info["gpu"] = gpu_info(device)
    return info


def cpu_label(info: Mapping[str, Any]) -> str:
    """Short text of the CPU, e.g. ``"AMD EPYC (AVX2, AVX-512 F, AVX-512 BF16)"``."""
    extensions: Iterable[str] = info.get("vector_extensions") or ()
    model = info.get("cpu_model") or "unknown CPU"
    return f"{model} ({', '.join(extensions)})" if extensions else model


def gpu_label(info: Mapping[str, Any]) -> str | None:
    """Short text of the GPU, e.g. ``"NVIDIA H100 80GB HBM3 (sm 9.0, 79.2 GiB, CUDA 13.0)"``, or
    None when the measurement ran on the CPU."""
    gpu = info.get("gpu")
    if not gpu:
        return None
    return (f"{gpu['name']} (sm {gpu['capability']}, {gpu['memory_gib']} GiB, "
            f"CUDA {gpu['cuda']})")


def describe(info: Mapping[str, Any]) -> str:
    """One line for the head of a printed summary: the GPU if any, CPU, cores, threads and, when
    measured, the matmul peaks and the reference GEMM's time."""
    gpu = gpu_label(info)
    text = (f"machine: {f'{gpu} on ' if gpu else ''}{cpu_label(info)}, "
            f"{info.get('cpu_count')} cores, torch "
            f"{info.get('torch')} with {info.get('torch_threads')} threads")
    peaks = info.get("matmul_peak_gflops") or {}
    if peaks:
        text += "; matmul peak " + ", ".join(
            f"{dtype} {gflops:.0f} GFLOP/s" if gflops else f"{dtype} n/a"
            for dtype, gflops in peaks.items())
    if info.get("reference_ms"):
        text += f"; reference GEMM {info['reference_ms']:.3g} ms"
    return text
