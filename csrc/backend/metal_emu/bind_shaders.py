#!/usr/bin/env python3
"""Binds metal/*.metal to the execution model: one C++ translation unit per shader file, plus a
library file that registers every kernel.

Kernel signatures are read from the source after the host compiler's preprocessor has expanded it
(so argument macros are seen as the Metal compiler sees them): each parameter's [[buffer(i)]],
[[threadgroup(i)]] or position attribute decides how the generated entry point binds it.
[[function_constant(i)]] declarations become variables of the file's namespace that the model
sets from the pipeline's specialisation constants before each dispatch. The shader text itself is compiled
unchanged except for two spellings the host compiler cannot take: the [[threadgroup(i)]]
attribute (renamed, as `threadgroup` is an address-space keyword) and the function-constant
declarations. Each file is wrapped in a namespace of its own, so kernels and helpers of different
files (or of two libraries binding copies of one file) never meet at link time.

Files that use the Metal 4 tensor API (<metal_tensor>, MetalPerformancePrimitives) bind like any
other: the model implements the part of it the shaders use (msl_tensor.h).

usage: bind_shaders.py --cxx C++ --include DIR [--include DIR ...] --out DIR --library NAME
                       shader.metal [shader.metal ...]
"""

from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
from pathlib import Path

POSITIONS = {
    "thread_position_in_grid",
    "thread_position_in_threadgroup",
    "thread_index_in_threadgroup",
    "threadgroup_position_in_grid",
    "threads_per_threadgroup",
    "dispatch_threads_per_threadgroup",
    "threadgroups_per_grid",
    "threads_per_grid",
    "simdgroup_index_in_threadgroup",
    "thread_index_in_simdgroup",
    "threads_per_simdgroup",
    "simdgroups_per_threadgroup",
}

KERNEL_RE = re.compile(r"\bkernel\s+void\s+(\w+)\s*\(")
ATTRIBUTE_RE = re.compile(r"\[\[\s*(\w+)\s*(?:\(\s*(\d+)\s*\))?\s*\]\]")
CONSTANT_RE = re.compile(r"\bconstant\s+([\w:]+)\s+(\w+)\s*\[\[\s*function_constant\(\s*(\d+)\s*\)\s*\]\]\s*;")
GROUP_VARIABLE_RE = re.compile(r"^\s*threadgroup\s+[\w:<>, ]+?\s+\w+\s*\[[^\]]*\]\s*;", re.M)


class BindError(Exception):
    pass


def preprocess(cxx: str, includes: list[str], source: Path) -> str:
    args = [cxx, "-E", "-P", "-x", "c++", "-std=c++20", "-D__METAL_VERSION__=310", "-DROUTEMM_MSL_SIGNATURES"]
    args += [f"-I{d}" for d in includes]
    done = subprocess.run([*args, str(source)], capture_output=True, text=True)
    if done.returncode != 0:
        raise BindError(f"{source}: the preprocessor failed:\n{done.stderr}")
    return done.stdout


def matching(text: str, start: int, open_: str = "(", close: str = ")") -> int:
    """Index just past the bracket closing the one opened before `start`."""
    depth = 1
    i = start
    while i < len(text) and depth:
        depth += {open_: 1, close: -1}.get(text[i], 0)
        i += 1
    if depth:
        raise BindError("unbalanced parameter list")
    return i


def split_top_level(params: str) -> list[str]:
    parts, current, depth = [], [], 0
    for c in params:
        if c in "([<":
            depth += 1
        elif c in ")]>":
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(c)
    parts.append("".join(current))
    return [" ".join(p.split()) for p in parts if p.strip()]


def parse_param(kernel: str, text: str) -> dict:
    attributes = ATTRIBUTE_RE.findall(text)
    if len(attributes) != 1:
        raise BindError(f"kernel {kernel}: parameter '{text}' needs exactly one binding attribute")
    attribute, index = attributes[0]
    declaration = ATTRIBUTE_RE.sub("", text).strip()
    name = re.search(r"(\w+)\s*$", declaration)
    if name is None:
        raise BindError(f"kernel {kernel}: cannot read the name of parameter '{text}'")
    type_ = declaration[: name.start()].strip()
    if attribute == "buffer":
        if "&" not in type_ and "*" not in type_:
            raise BindError(
                f"kernel {kernel}: [[buffer({index})]] parameter '{text}' is neither a pointer nor a reference"
            )
        return {"kind": "Buffer", "index": int(index), "type": type_, "text": text, "reference": "&" in type_}
    if attribute == "threadgroup":
        if "*" not in type_:
            raise BindError(f"kernel {kernel}: [[threadgroup({index})]] parameter '{text}' is not a pointer")
        return {"kind": "Threadgroup", "index": int(index), "type": type_, "text": text}
    if attribute in POSITIONS and not index:
        return {"kind": "Position", "position": attribute, "type": type_, "text": text}
    raise BindError(f"kernel {kernel}: attribute [[{attribute}]] of '{text}' is not modelled")


def kernels_of(preprocessed: str) -> list[tuple[str, list[dict]]]:
    out = []
    for match in KERNEL_RE.finditer(preprocessed):
        end = matching(preprocessed, match.end())
        params = split_top_level(preprocessed[match.end() : end - 1])
        out.append((match.group(1), [parse_param(match.group(1), p) for p in params]))
    return out


def c_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def identifier(path: Path) -> str:
    return re.sub(r"\W", "_", path.stem)


def pin_local_includes(text: str, source: Path) -> str:
    """`#include "x"` naming a file beside `source` becomes that file's absolute path: the
    generated unit lives elsewhere, and a quoted include means the including file's folder first
    (a seeded copy of a shader finds its seeded header, not the original)."""

    def pin(m: re.Match) -> str:
        local = source.parent / m.group(2)
        return f"{m.group(1)}{c_string(str(local.resolve()))}" if local.is_file() else m.group(0)

    return re.sub(r'^(\s*#\s*include\s*)"([^"]+)"', pin, text, flags=re.MULTILINE)


def bind_file(source: Path, library: str, cxx: str, includes: list[str]) -> tuple[str, list[str]]:
    """The translation unit for `source` and its kernel names."""
    text = source.read_text()
    preprocessed = preprocess(cxx, includes, source)
    kernels = kernels_of(preprocessed)
    stem = f"{library}_{identifier(source)}"
    if GROUP_VARIABLE_RE.search(preprocessed):
        raise BindError(
            f"{source}: threadgroup variables declared inside functions are not modelled; "
            "pass threadgroup memory as a [[threadgroup(i)]] parameter"
        )
    text = pin_local_includes(text, source)
    constants = CONSTANT_RE.findall(text)
    body = CONSTANT_RE.sub(lambda m: f"{m.group(1)} {m.group(2)};", text)
    body = body.replace("[[threadgroup(", "[[threadgroup_binding(")
    hoisted = [line for line in text.splitlines() if re.match(r"\s*#\s*include\b", line)]
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    ns = f"routemm_msl_{stem}"
    out = [
        f"// Generated by csrc/backend/metal_emu/bind_shaders.py from {source.name}; do not edit.",
        "// Host headers first: msl.h defines MSL's address-space keywords as macros.",
        "#include <type_traits>",
        '#include "backend/metal_emu/runtime.h"',
        "#include <metal_stdlib>",
        *hoisted,
        '#include "backend/metal_emu/bind.h"',
        f"namespace {ns} {{",
        f"#line 1 {c_string(str(source))}",
        body,
        f"}}  // namespace {ns}",
        f"namespace {ns} {{",
        "namespace emu = ::routemm::metal_emu;",
        "void routemm_emu_constants(const emu::Invocation& invocation) {",
    ]
    for type_, name, index in constants:
        out.append(f"  {name} = static_cast<{type_}>(emu::function_constant(invocation, {index}, {c_string(name)}));")
    out.append("}")
    for name, params in kernels:
        args = []
        for p in params:
            if p["kind"] == "Buffer":
                args.append(f"emu::bind_buffer<{p['type']}>(invocation, {p['index']})")
            elif p["kind"] == "Threadgroup":
                args.append(f"emu::bind_threadgroup<{p['type']}>(invocation, {p['index']})")
            else:
                args.append(f"emu::bind_position<{p['type']}>(invocation, emu::Position::{p['position']})")
        for p in params:
            if p["kind"] == "Buffer" and p["reference"]:
                out.append(
                    f"constexpr size_t routemm_emu_bytes_{name}_{p['index']} = sizeof(std::remove_reference_t<{p['type']}>);"
                )
        out.append(f"void routemm_emu_entry_{name}(const emu::Invocation& invocation) {{")
        out.append(f"  {name}({', '.join(args)});")
        out.append("}")
    out.append(f"}}  // namespace {ns}")
    out.append(f"void routemm_emu_register_{stem}(::routemm::metal_emu::ShaderLibrary& library) {{")
    out.append("  using ::routemm::metal_emu::KernelParam;")
    for name, params in kernels:
        out.append("  {")
        out.append("    ::routemm::metal_emu::ShaderKernel k;")
        out.append(f"    k.name = {c_string(name)};")
        out.append(f"    k.file = {c_string(source.name)};")
        out.append(f"    k.source_sha256 = {c_string(digest)};")
        out.append(f"    k.entry = &{ns}::routemm_emu_entry_{name};")
        out.append(f"    k.set_constants = &{ns}::routemm_emu_constants;")
        for p in params:
            if p["kind"] == "Buffer":
                size = f"{ns}::routemm_emu_bytes_{name}_{p['index']}" if p["reference"] else "0"
                kind, index = "Buffer", str(p["index"])
            elif p["kind"] == "Threadgroup":
                size, kind, index = "0", "Threadgroup", str(p["index"])
            else:
                size, kind = "0", "Position"
                index = f"static_cast<uint32_t>(::routemm::metal_emu::Position::{p['position']})"
            out.append(
                f"    k.params.push_back(KernelParam{{KernelParam::Kind::{kind}, {index}, {size}, {c_string(p['text'])}}});"
            )
        for _, cname, index in constants:
            out.append(f"    k.function_constants.emplace_back({index}, {c_string(cname)});")
        out.append("    library.add(std::move(k));")
        out.append("  }")
    out.append("}")
    return "\n".join(out) + "\n", [name for name, _ in kernels]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cxx", required=True)
    parser.add_argument("--include", action="append", default=[])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--library", required=True)
    parser.add_argument("shaders", nargs="+", type=Path)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    registered = []
    try:
        for shader in args.shaders:
            content, _ = bind_file(shader.resolve(), args.library, args.cxx, args.include)
            registered.append(f"{args.library}_{identifier(shader)}")
            target = args.out / f"{shader.name}.cpp"
            if not target.exists() or target.read_text() != content:
                target.write_text(content)
    except BindError as error:
        print(f"bind_shaders.py: {error}", file=sys.stderr)
        return 1
    lines = [
        "// Generated by csrc/backend/metal_emu/bind_shaders.py; do not edit.",
        '#include "backend/metal_emu/runtime.h"',
        *[f"void routemm_emu_register_{stem}(::routemm::metal_emu::ShaderLibrary&);" for stem in registered],
        "namespace routemm::metal_emu {",
        f"const ShaderLibrary& library_{args.library}() {{",
        "  static const ShaderLibrary library = [] {",
        "    ShaderLibrary out;",
        *[f"    routemm_emu_register_{stem}(out);" for stem in registered],
        "    return out;",
        "  }();",
        "  return library;",
        "}",
        "}  // namespace routemm::metal_emu",
    ]
    library = args.out / f"library_{args.library}.cpp"
    content = "\n".join(lines) + "\n"
    if not library.exists() or library.read_text() != content:
        library.write_text(content)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
