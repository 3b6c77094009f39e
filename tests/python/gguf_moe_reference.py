"""Float64 reference of one MoE layer of a GGUF file, from the file alone: the weights read with the
`gguf` package's reader and dequantisers (not routemm's), the computation as llama.cpp's
build_moe_ffn does it for the file's architecture (src/llama-graph.cpp, src/models/*.cpp):

- logits = W_router x (+ the router bias ffn_gate_inp.bias, gpt-oss: llama.cpp adds it to the router
  matmul's output, before any scoring);
- probs = softmax(logits) (qwen3moe, qwen2moe, llama) or sigmoid(logits) (llama4; deepseek2
  and glm4moe by `expert_gating_func`, 1 softmax / 2 sigmoid, default softmax / sigmoid); gpt-oss
  (LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT): the biased logits themselves;
- selection scores = probs + exp_probs_b (llama4: the logits); with `expert_group_count` G > 1 only
  the `expert_group_used_count` best groups (a group scored by the sum of its two largest scores)
  stay; the top-k scores, ties to the lower index;
- weights = probs of the selected experts; gpt-oss: softmax over the selected (biased) logits, never
  renormalised nor scaled (its graph passes norm_w false and reads no expert_weights_scale); others
  divided by their sum (at least 6.103515625e-5) where the file's `expert_weights_norm` says so, else
  by architecture (qwen3moe, llama yes; others no); times `expert_weights_scale` (deepseek2,
  glm4moe) when it is not 0 or 1;
- each selected expert: SiLU(g) * u, or gpt-oss's swiglu_oai (alpha 1.702, limit 7) with its biases;
  llama4 scales the expert's input by the weight instead of its output;
- shared experts added: qwen2moe's weighed by sigmoid(x . ffn_gate_inp_shexp).
"""

from __future__ import annotations

import numpy as np

gguf = __import__("gguf")

RENORMALIZE = {"qwen3moe": True, "llama": True, "qwen2moe": False, "llama4": False, "gpt-oss": False}
DEFAULT_SIGMOID = {"glm4moe", "llama4"}


def read_tensors(path) -> tuple[dict, dict]:
    """(metadata {key: value}, {tensor name: float64 array in row-major logical shape})."""
    reader = gguf.GGUFReader(str(path))
    meta = {}
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            meta[key] = field.contents()
    tensors = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        tensors[t.name] = np.asarray(values, dtype=np.float64).reshape(shape)
    return meta, tensors


def _stack(tensors: dict, blk: str, part: str, n_experts: int) -> np.ndarray:
    name = f"{blk}.ffn_{part}_exps.weight"
    if name in tensors:
        return tensors[name]
    return np.stack([tensors[f"{blk}.ffn_{part}.{e}.weight"] for e in range(n_experts)])


def _ffn(x, gate, up, down, activation="silu", biases=(0.0, 0.0, 0.0)):
    g = x @ gate.T + biases[0]
    u = x @ up.T + biases[1]
    if activation == "swiglu_oai":
        g = np.minimum(g, 7.0)
        u = np.clip(u, -7.0, 7.0)
        h = g / (1.0 + np.exp(-1.702 * g)) * (u + 1.0)
    else:
        h = g / (1.0 + np.exp(-g)) * u
    return h @ down.T + biases[2]


def layer_reference(path, layer: int, x: np.ndarray, *, read=None):
    """(out float64 [m, H], selection scores [m, E] after group masking, top_k) for hidden x."""
    meta, tensors = read or read_tensors(path)
    arch = meta["general.architecture"]
    blk = f"blk.{layer}"
    x = np.asarray(x, dtype=np.float64)
    n_experts, top_k = int(meta[f"{arch}.expert_count"]), int(meta[f"{arch}.expert_used_count"])
    logits = x @ tensors[f"{blk}.ffn_gate_inp.weight"].T
    if f"{blk}.ffn_gate_inp.bias" in tensors:
        logits = logits + tensors[f"{blk}.ffn_gate_inp.bias"]
    gating = int(meta.get(f"{arch}.expert_gating_func", 2 if arch in DEFAULT_SIGMOID else 1))
    if arch == "llama4":
        gating = 2
    if arch == "gpt-oss":
        probs = logits  # selection by the biased logits; the weights' softmax comes after top-k
    elif gating == 2:
        probs = 1.0 / (1.0 + np.exp(-logits))
    else:
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs = e / e.sum(axis=1, keepdims=True)
    select = probs + tensors.get(f"{blk}.exp_probs_b.bias", 0.0)
    if arch == "llama4":
        select = logits.copy()
    groups = int(meta.get(f"{arch}.expert_group_count", 1))
    if groups > 1:
        used = int(meta[f"{arch}.expert_group_used_count"])
        grouped = select.reshape(len(x), groups, n_experts // groups)
        score = np.sort(grouped, axis=2)[:, :, -2:].sum(axis=2)
        keep = np.argsort(-score, axis=1, kind="stable")[:, :used]
        mask = np.full(score.shape, -np.inf)
        np.put_along_axis(mask, keep, 0.0, axis=1)
        select = (grouped + mask[:, :, None]).reshape(len(x), n_experts)
    ids = np.argsort(-select, axis=1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(probs, ids, axis=1)
    if arch == "gpt-oss":
        chosen = np.take_along_axis(logits, ids, axis=1)
        e = np.exp(chosen - chosen.max(axis=1, keepdims=True))
        weights = e / e.sum(axis=1, keepdims=True)
    norm = arch != "gpt-oss" and meta.get(f"{arch}.expert_weights_norm", RENORMALIZE.get(arch, False))
    if norm:
        weights = weights / np.maximum(weights.sum(axis=1, keepdims=True), 6.103515625e-5)
    scale = float(meta.get(f"{arch}.expert_weights_scale", 0.0)) if arch in ("deepseek2", "glm4moe") else 0.0
    if scale not in (0.0, 1.0):
        weights = weights * scale
    gate, up, down = (_stack(tensors, blk, part, n_experts) for part in ("gate", "up", "down"))
    activation = "swiglu_oai" if arch == "gpt-oss" else "silu"
    bias = {
        part: tensors.get(f"{blk}.ffn_{part}_exps.bias", np.zeros((n_experts, 1))) for part in ("gate", "up", "down")
    }
    out = np.zeros_like(x)
    for t in range(len(x)):
        for s in range(top_k):
            e, w = ids[t, s], weights[t, s]
            biases = (bias["gate"][e], bias["up"][e], bias["down"][e])
            if arch == "llama4":
                out[t] += _ffn(w * x[t : t + 1], gate[e], up[e], down[e], activation, biases)[0]
            else:
                out[t] += w * _ffn(x[t : t + 1], gate[e], up[e], down[e], activation, biases)[0]
    if f"{blk}.ffn_gate_shexp.weight" in tensors:
        shared = _ffn(x, *(tensors[f"{blk}.ffn_{p}_shexp.weight"] for p in ("gate", "up", "down")))
        if f"{blk}.ffn_gate_inp_shexp.weight" in tensors:
            shared = shared / (1.0 + np.exp(-(x @ tensors[f"{blk}.ffn_gate_inp_shexp.weight"])))[:, None]
        out = out + shared
    return out, select, top_k


def near_tie(select: np.ndarray, top_k: int, gap: float = 1e-4) -> np.ndarray:
    """Tokens whose k-th and (k+1)-th selection scores are within `gap`: F32 may rank them otherwise."""
    ranked = np.sort(select, axis=1)[:, ::-1]
    if top_k >= ranked.shape[1]:
        return np.zeros(len(select), bool)
    return (ranked[:, top_k - 1] - ranked[:, top_k]) < gap
