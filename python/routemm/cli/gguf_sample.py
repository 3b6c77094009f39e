"""`python -m routemm gguf-sample FILE`: writes a small MoE GGUF file to run `demo --gguf` on.

The file holds what MoeLayer.from_gguf reads, laid out as a real conversion lays it out: per layer
the router `blk.N.ffn_gate_inp.weight` [E, H] (F32) and the expert stacks
`blk.N.ffn_{gate,up}_exps.weight` [E, I, H] and `blk.N.ffn_down_exps.weight` [E, H, I] of one type
(f32, f16, bf16, q4_0 or q8_0), with the architecture's metadata (`<arch>.block_count`,
`embedding_length`, `expert_count`, `expert_used_count`, `expert_feed_forward_length`). Mixtral's
files name the architecture "llama", as llama.cpp's conversion does. There are no attention or
embedding tensors: it is a file of MoE layers, not a model llama.cpp can run. The weights are random
(a seeded NumPy generator, scaled by 1/sqrt(fan-in)), so the same arguments write the same bytes.
Needs the `gguf` package (`python -m pip install gguf`).
"""

from __future__ import annotations

import argparse

import numpy as np

from ..core._errors import MissingDependencyError
from .demo import _integer

# --arch -> the architecture name the file records.
ARCHITECTURES = {"qwen3moe": "qwen3moe", "mixtral": "llama"}
EXPERT_TYPES = ("f32", "f16", "bf16", "q4_0", "q8_0")
_BLOCK_TYPES = ("q4_0", "q8_0")  # 32 values per block along the input width

_POSITIVE = _integer(1, "a positive integer")
_NON_NEGATIVE = _integer(0, "a non-negative integer")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="the GGUF file to write (replaced if it exists)")
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default="qwen3moe", help="default qwen3moe")
    parser.add_argument("--type", choices=EXPERT_TYPES, default="q4_0", help="the expert stacks' type (default q4_0)")
    parser.add_argument("--layers", type=_POSITIVE, default=2, help="MoE layers (default 2)")
    parser.add_argument("--experts", type=_POSITIVE, default=8, help="experts per layer (default 8)")
    parser.add_argument("--top-k", type=_POSITIVE, default=2, help="experts used per token (default 2)")
    parser.add_argument("--hidden", type=_POSITIVE, default=64, help="hidden size H (default 64)")
    parser.add_argument("--intermediate", type=_POSITIVE, default=32, help="expert intermediate size I (default 32)")
    parser.add_argument("--seed", type=_NON_NEGATIVE, default=0, help="seed of the random weights (default 0)")


def _check(args, parser) -> None:
    if args.top_k > args.experts:
        parser.error(f"--top-k {args.top_k} is more than --experts {args.experts}")
    if args.type in _BLOCK_TYPES:
        for name in ("hidden", "intermediate"):
            value = getattr(args, name)
            if value % 32:
                parser.error(f"--{name} {value} must be a multiple of 32 for {args.type} experts (32-value blocks)")


def _encode(gguf, w: np.ndarray, kind: str):
    """(data, raw_dtype) for GGUFWriter.add_tensor: floats as themselves, bf16 as its bits, blocks quantised."""
    if kind == "f32":
        return w, None
    if kind == "f16":
        return w.astype(np.float16), None
    if kind == "bf16":
        import ml_dtypes

        return w.astype(ml_dtypes.bfloat16).view(np.uint16), gguf.GGMLQuantizationType.BF16
    qtype = {"q4_0": gguf.GGMLQuantizationType.Q4_0, "q8_0": gguf.GGMLQuantizationType.Q8_0}[kind]
    return gguf.quants.quantize(w, qtype), qtype


def write(
    path, *, arch: str, kind: str, layers: int, experts: int, top_k: int, hidden: int, intermediate: int, seed: int
):
    """Writes the sample file (arguments as the command's, checked by it); returns the file's architecture."""
    try:
        import gguf
    except ImportError:
        raise MissingDependencyError("gguf-sample needs the gguf package: python -m pip install gguf") from None
    file_arch = ARCHITECTURES[arch]
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch=file_arch)
    writer.add_string("general.name", f"routemm gguf-sample {arch} {kind}")
    writer.add_block_count(layers)
    writer.add_embedding_length(hidden)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(top_k)
    writer.add_expert_feed_forward_length(intermediate)
    for layer in range(layers):
        router = (rng.standard_normal((experts, hidden)) / np.sqrt(hidden)).astype(np.float32)
        writer.add_tensor(f"blk.{layer}.ffn_gate_inp.weight", router)
        for part, shape, fan_in in (
            ("gate", (experts, intermediate, hidden), hidden),
            ("up", (experts, intermediate, hidden), hidden),
            ("down", (experts, hidden, intermediate), intermediate),
        ):
            w = (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)
            data, raw = _encode(gguf, w, kind)
            writer.add_tensor(f"blk.{layer}.ffn_{part}_exps.weight", data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return file_arch


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    _check(args, parser)
    file_arch = write(
        args.file,
        arch=args.arch,
        kind=args.type,
        layers=args.layers,
        experts=args.experts,
        top_k=args.top_k,
        hidden=args.hidden,
        intermediate=args.intermediate,
        seed=args.seed,
    )
    print(
        f"wrote {args.file}: {file_arch}, {args.layers} layers, {args.experts} experts (top {args.top_k}), "
        f"H={args.hidden}, I={args.intermediate}, {args.type} experts, f32 router; "
        f"run it: python -m routemm demo --gguf {args.file}"
    )
    return 0
