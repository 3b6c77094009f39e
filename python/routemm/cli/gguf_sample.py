"""`python -m routemm gguf-sample FILE`: writes a MoE GGUF file to run `demo --gguf` on.

The file is laid out as llama.cpp's conversions lay a model out (its tensor names and metadata
keys), for one of the architectures qwen3moe, qwen2moe, mixtral (recorded as "llama"; with
--split-experts as per-expert 2-D tensors, as 2023 files have them), deepseek2, glm4moe, gpt-oss
(MXFP4 experts with biases) and llama4 (every second layer MoE), with the expert weights in one
type (f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q4_k, q5_k, q6_k, mxfp4) or a llama.cpp mix
(q4_k_m, q5_k_m: down Q6_K in some layers, 32-value fallbacks for rows not a multiple of 256).
The routers, biases and 1-D tensors are F32. There are no attention or embedding tensors: it is a
file of FFN layers, not a model llama.cpp can run. The weights are random (a seeded NumPy
generator, scaled by 1/sqrt(fan-in)), so the same arguments write the same bytes; --shape real
takes the real model's sizes (write a layer or two of them with --layers: the leading dense layers
are then cut to leave at least one MoE layer). The writer is
routemm.formats.gguf_moe_writer. Needs the `gguf` package (`python -m pip install gguf`).
"""

from __future__ import annotations

import argparse

from ..formats.gguf_moe_writer import ARCHITECTURES, FLOAT_TYPES, REAL_SHAPES, TYPE_MIXES, MoeGgufSpec, write_moe_gguf
from .demo import _integer

_POSITIVE = _integer(1, "a positive integer")
_NON_NEGATIVE = _integer(0, "a non-negative integer")
_SMALL = {"layers": 2, "experts": 8, "hidden": 64, "intermediate": 32}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="the GGUF file to write (replaced if it exists)")
    parser.add_argument("--arch", choices=list(ARCHITECTURES), default="qwen3moe", help="default qwen3moe")
    parser.add_argument(
        "--type", choices=TYPE_MIXES, default="q4_0", help="the expert weights' type or llama.cpp mix (default q4_0)"
    )
    parser.add_argument("--shape", choices=("small", "real"), default="small", help="default sizes (default small)")
    parser.add_argument("--layers", type=_POSITIVE, help="layers (default 2; real: the model's)")
    parser.add_argument("--experts", type=_POSITIVE, help="experts per layer (default 8)")
    parser.add_argument("--top-k", type=_POSITIVE, help="experts used per token (default 2, llama4 1)")
    parser.add_argument("--hidden", type=_POSITIVE, help="hidden size H (default 64)")
    parser.add_argument("--intermediate", type=_POSITIVE, help="expert intermediate size I (default 32)")
    parser.add_argument("--split-experts", action="store_true", help="mixtral: per-expert 2-D tensors")
    parser.add_argument("--seed", type=_NON_NEGATIVE, default=0, help="seed of the random weights (default 0)")


def _spec(args, parser) -> MoeGgufSpec:
    sizes = dict(REAL_SHAPES[args.arch]) if args.shape == "real" else dict(_SMALL)
    for name in ("layers", "experts", "top_k", "hidden", "intermediate"):
        if getattr(args, name) is not None:
            sizes[name] = getattr(args, name)
    if "leading_dense" in sizes:  # a few layers of a real shape keep at least one MoE layer
        sizes["leading_dense"] = min(sizes["leading_dense"], sizes["layers"] - 1)
    top_k = sizes.get("top_k", 1 if args.arch == "llama4" else 2)
    if top_k > sizes["experts"]:
        parser.error(f"--top-k {top_k} is more than --experts {sizes['experts']}")
    if args.split_experts and args.arch != "mixtral":
        parser.error("--split-experts is for --arch mixtral only")
    if args.type not in FLOAT_TYPES:
        for name in ("hidden", "intermediate"):
            if sizes[name] % 32:
                parser.error(
                    f"--{name} {sizes[name]} must be a multiple of 32 for {args.type} experts (32-value blocks)"
                )
    spec = MoeGgufSpec(arch=args.arch, mix=args.type, split_experts=args.split_experts, seed=args.seed, **sizes)
    try:
        return spec.resolved()
    except ValueError as e:  # the spec's own checks (groups, layer kinds), one line
        parser.error(str(e).removeprefix("gguf writer: "))


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    spec = _spec(args, parser)
    write_moe_gguf(args.file, spec)
    print(
        f"wrote {args.file}: {ARCHITECTURES[spec.arch]}, {spec.layers} layers, {spec.experts} experts "
        f"(top {spec.top_k}), H={spec.hidden}, I={spec.intermediate}, {spec.mix} experts, f32 router; "
        f"run it: python -m routemm demo --gguf {args.file}"
    )
    return 0
