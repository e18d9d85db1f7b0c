"""What the triton strategy's kernels need of a GPU, found without one: each kernel compiled
ahead of time for a CUDA architecture, with its registers per thread, spilled bytes (stack) and
shared memory per program.

Triton compiles for a target without a driver (``triton.compile`` with a ``GPUTarget``; its
wheel brings ``ptxas`` and ``cuobjdump``), so a CPU machine can say whether a kernel fits a
GPU's shared memory (a kernel over the limit does not launch), and whether it spills registers
to local memory (slower, not wrong), at the tile sizes ``effattn.kernelized.fused_kernels.meta``
chooses for each dtype. ``tf32`` is fp32 with torch's fp32 CUDA matmuls set to TF32
(``torch.set_float32_matmul_precision("high")``), which the kernels' fp32 products follow
(``fused_kernels.precision``); ``fp32`` is the default, IEEE. ``bf16-values`` is what a module
runs for bf16 inputs: φ and the products in fp32 (IEEE), v read in bf16 (and q, k for the elu
map, which reads them as they are). Not its speed: that needs the GPU
(``benchmarks/gpu_peers.py``).

    python3 benchmarks/triton_resources.py                     # sm_80 and sm_90, every dtype
    python3 benchmarks/triton_resources.py --archs 90 --dtypes bf16

Writes ``<out>/results.json`` and ``results.csv``; exits 2 with one line on a bad argument or
without triton.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from effattn.tools.bench.machine import describe, machine_info
from effattn.tools.bench.results import write_csv, write_json

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
          "tf32": torch.float32, "bf16-values": torch.float32, "fp64": torch.float64}
# Variants whose values are narrower than φ (the kernels convert their tiles after loading).
VALUES = {"bf16-values": "*bf16"}
# Shared memory a program may use, per architecture (bytes; the CUDA programming guide's
# maximum per block with opt-in).
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
FIELDS = ["arch", "dtype", "kernel", "gated", "map", "key_dim", "chunk", "feature_block",
          "num_warps", "registers", "spill_bytes", "shared_bytes", "shared_limit", "fits"]


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    unknown = sorted(set(values) - set(SHARED_LIMIT))
    if unknown or not values:
        raise argparse.ArgumentTypeError(
            f"unknown architectures {unknown or text!r}; choose from {sorted(SHARED_LIMIT)}")
    return values


def _dtypes(text: str) -> list[str]:
    names = [x for x in text.split(",") if x]
    unknown = sorted(set(names) - set(DTYPES))
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown dtypes {unknown or text!r}; choose from {sorted(DTYPES)}")
    return names


@contextlib.contextmanager
def _fp32_products(name: str) -> Iterator[None]:
    """torch's fp32 CUDA matmuls set to TF32 for ``name`` "tf32" (restored after)."""
    before = torch.backends.cuda.matmul.fp32_precision
    if name == "tf32":
        torch.backends.cuda.matmul.fp32_precision = "tf32"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.fp32_precision = before


# How a kernel gets φ (its MAP): read from memory, or formed inside as exp (the positive maps),
# sin (the trigonometric ones), relu (the rectified ones), a product of two affine maps
# (Taylor's) or elu + 1 of x itself (the linear transformer's). The per-feature core's kernels
# (effattn.kernelized.fused_exponents_kernels, Hedgehog's exp map) have one map of their own,
# ``exponents``: their rows.
MAPS = ("read", "exp", "sine", "relu", "product", "elu")
# x̃'s width D where a map's own differs from the head dim: Taylor's projection, P = 16.
KEY_DIMS = {"product": 16}
# F where a map's own differs: Hedgehog's 2 x 64 features at D = 64.
FEATURE_DIMS = {"exponents": 128}
# The per-feature kernels compute in fp32 (fp64) whatever the inputs: half-precision q, k, v are
# read as they are (``bf16-values``), never as half-precision tiles.
HALF = ("bf16", "fp16")


def all_kernels() -> tuple[Any, ...]:
    """The row core's kernels, then the per-feature core's."""
    from effattn.kernelized import fused_exponents_kernels, fused_kernels

    return fused_kernels.KERNELS + fused_exponents_kernels.KERNELS


def applies(map_: str, name: str) -> bool:
    """Whether kernels of map ``map_`` run inputs ``name`` (a key of ``DTYPES``)."""
    return not (map_ == "exponents" and name in HALF)


def compile_kernel(kernel: Any, arch: int, name: str, gated: bool, map_: str = "read",
                   feature_dim: int = 256, value_dim: int = 64, key_dim: int = 64,
                   chunk: int = 32) -> dict[str, Any]:
    """Compile one kernel of ``effattn.kernelized.fused_kernels`` for sm_<arch> with the
    launch's constexprs for inputs ``name`` (a key of ``DTYPES``), with or without gates, with
    φ read from memory or formed in the kernel (``map_``, one of ``MAPS``), and return its
    resources."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from effattn.kernelized import fused_exponents_kernels, fused_kernels

    if not isinstance(kernel, JITFunction):
        raise RuntimeError("compiling for a GPU needs TRITON_INTERPRET unset: the kernels were "
                           "made for Triton's interpreter")
    dtype = DTYPES[name]
    with _fp32_products(name):
        meta = fused_kernels.meta(dtype, chunk, feature_dim, value_dim, key_dim,
                                  map_ != "read")
    warps = meta.pop("num_warps")
    if kernel is fused_kernels._divisor_grad_kernel:
        meta["BT"], warps = fused_kernels.RATIO_TOKENS, fused_kernels.RATIO_WARPS
    short = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
             torch.float64: "fp64"}
    inputs, acc = "*" + short[dtype], "*" + ("fp64" if dtype == torch.float64 else "fp32")
    # Feature blocks add their parts atomically wherever there are several, as at F = 256
    # (fused_kernels.atomic); the elu map's F is D.
    blocks = -(-(key_dim if map_ == "elu" else feature_dim) // meta["BK"])
    # The segments' first passes (STATES, ADJOINT) do a part of their kernels' work: the
    # kernels as the main passes run them are compiled.
    constants = {**meta, "LOG_FLOOR_": fused_kernels.LOG_FLOOR, "GATED": gated,
                 "ATOMIC": fused_kernels.atomic(blocks), "STATES": False, "ADJOINT": False}
    if map_ == "exponents":
        constants["LIMIT"] = fused_exponents_kernels.GROWTH[
            torch.float64 if dtype == torch.float64 else torch.float32]
    else:
        constants["MAP"] = getattr(fused_kernels, map_.upper()).value
    integers = fused_kernels.INTEGERS | fused_exponents_kernels.INTEGERS
    signature, constexprs = {}, {}
    for arg in kernel.arg_names:
        if arg in constants:
            signature[arg], constexprs[arg] = "constexpr", constants[arg]
        elif arg in integers:
            signature[arg] = "i32"
        else:
            signature[arg] = inputs if arg in fused_kernels.INPUTS else acc
    if name in VALUES:
        # The values, the output and its gradient, and for the maps that read x itself (elu,
        # the per-feature exponents) the queries and keys.
        narrow = ("v_ptr", "o_ptr", "do_ptr") + (("q_ptr", "k_ptr")
                                                 if map_ in ("elu", "exponents") else ())
        signature.update({arg: VALUES[name] for arg in narrow if arg in signature})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Triton's notice about its FP-fusion default
        compiled = triton.compile(ASTSource(kernel, signature, constexprs),
                                  target=GPUTarget("cuda", arch, 32),
                                  options={"num_warps": warps})
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True,
                               text=True, check=True).stdout
    fields = dict(item.split(":")[:2] for line in usage.splitlines() if "REG:" in line
                  for item in line.split() if ":" in item)
    shared = int(compiled.metadata.shared)
    return {"arch": arch, "dtype": name, "kernel": kernel.__name__.strip("_"),
            "gated": gated, "map": map_, "key_dim": key_dim,
            "chunk": meta["BT"], "feature_block": meta["BK"], "num_warps": warps,
            "registers": int(fields["REG"]), "spill_bytes": int(fields["STACK"]),
            "shared_bytes": shared, "shared_limit": SHARED_LIMIT[arch],
            "fits": shared <= SHARED_LIMIT[arch]}


def variants(kernels: Any) -> list[tuple[Any, bool, str]]:
    """(kernel, gated, map) to compile: the scan's kernels ungated and gated, with φ from
    memory and formed inside (each of ``MAPS``); the row maxima's kernel once; the per-feature
    core's kernels once each (map ``exponents``)."""
    from effattn.kernelized import fused_exponents_kernels

    out = []
    for kernel in kernels:
        # By identity: under Triton's interpreter a kernel's __module__ is the interpreter's.
        if kernel in fused_exponents_kernels.KERNELS:
            out.append((kernel, False, "exponents"))
        elif "MAP" in kernel.arg_names:
            out += [(kernel, g, m) for g, m in itertools.product((False, True), MAPS)]
        else:
            out.append((kernel, False, "read"))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", type=_ints, default=[80, 90],
                        help="CUDA architectures, e.g. 80,90 (default)")
    parser.add_argument("--dtypes", type=_dtypes, default=list(DTYPES),
                        help="comma-separated: " + ", ".join(DTYPES))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/triton-resources"))
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.exit(2, "triton_resources: unset TRITON_INTERPRET (compiling for a GPU, not "
                       "interpreting)\n")
    try:
        kernels = all_kernels()
    except ImportError as err:
        parser.exit(2, f"triton_resources: needs triton ({err})\n")
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        parser.exit(2, f"--out {args.out}: {err.strerror}\n")
    print(describe(machine_info()))
    rows = []
    try:
        for arch in args.archs:
            for name in args.dtypes:
                for kernel, gated, map_ in variants(kernels):
                    if not applies(map_, name):
                        continue
                    rows.append(compile_kernel(kernel, arch, name, gated, map_,
                                               feature_dim=FEATURE_DIMS.get(map_, 256),
                                               key_dim=KEY_DIMS.get(map_, 64)))
                    r = rows[-1]
                    print(f"sm_{arch} {name:4s} {r['kernel']:24s} "
                          f"{'gated' if gated else '     '} {map_:4s} "
                          f"C={r['chunk']:2d} "
                          f"BK={r['feature_block']} warps={r['num_warps']} "
                          f"regs={r['registers']:3d} spill={r['spill_bytes']:5d} B "
                          f"shared={r['shared_bytes'] / 1024:6.1f} KiB"
                          f"{'' if r['fits'] else ' DOES NOT FIT'}", flush=True)
    except KeyboardInterrupt:
        print("interrupted: nothing written; rerun the same command", file=sys.stderr)
        return 130
    write_json(args.out / "results.json", {"machine": machine_info(), "rows": rows,
                                           "triton": __import__("triton").__version__})
    write_csv(args.out / "results.csv", rows, FIELDS)
    print(f"wrote {args.out}/results.json and results.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
