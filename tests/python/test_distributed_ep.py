"""routemm.integrations.distributed: the expert-parallel MoE experts block on torch.distributed.

Ranks are processes from torch.multiprocessing.spawn on the gloo backend (CPU). Every rank's output
must be bit-identical to the single-process torch.ops.routemm.moe_experts(..., exact=True) on the
concatenated tokens, for world sizes 1, 2 and 4, float and block stacks, uneven and explicit
placements, ranks without tokens or without experts, sentinel ids; a rank that raises makes the
others fail within the group's timeout instead of hanging.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import socket
import time
import traceback

import numpy as np
import pytest
import routemm

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with the gloo backend is not available", allow_module_level=True)

import routemm.torch  # noqa: E402,F401  (torch.ops.routemm.*)
import torch.multiprocessing as mp  # noqa: E402
from routemm.integrations.distributed import ExpertPlacement, ep_capacity_dropped, ep_moe_experts  # noqa: E402
from routemm.ops import _tensor_ops  # noqa: E402

E, H, I = 7, 64, 32  # noqa: E741  (I and H multiples of 32: the block stacks' rows)
CASE_TIMEOUT_S = 60  # the group's collective timeout in the cases' runs (4 ranks on 2 cores)
RAISE_TIMEOUT_S = 3  # the group's collective timeout where a rank raises
LINGER_S = 4 * RAISE_TIMEOUT_S  # how long the rank that raised stays alive, its connections open
SPLITS = {1: [6], 2: [5, 0], 4: [3, 0, 6, 2]}  # tokens per rank: rank 1 has none


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ids(g, m: int, top_k: int, experts) -> torch.Tensor:
    experts = torch.tensor(experts)
    return torch.stack([experts[torch.randperm(len(experts), generator=g)[:top_k]] for _ in range(m)])


def _cases(world: int) -> dict:
    """Every case's whole data: full stacks, the concatenated tokens, the placement."""
    g = torch.Generator().manual_seed(world)
    rng = np.random.default_rng(world)
    m = sum(SPLITS[world])
    cases = {}

    def floats(dtype, split=False):
        gate_up = (torch.randn((E, 2 * I, H), generator=g) / H**0.5).to(dtype)
        down = (torch.randn((E, H, I), generator=g) / I**0.5).to(dtype)
        if split:
            return {"gate_up": gate_up[:, :I].contiguous(), "up": gate_up[:, I:].contiguous(), "down": down}
        return {"gate_up": gate_up, "down": down}

    def blocks(fmt):
        gate, up = (torch.from_numpy(fmt.quantize(rng.standard_normal((E, I, H)).astype(np.float32))) for _ in "gu")
        down = torch.from_numpy(fmt.quantize(rng.standard_normal((E, H, I)).astype(np.float32)))
        return {"gate_up": gate, "up": up, "down": down}

    def tokens(top_k, experts=range(E), sentinels=True, hidden_dtype=torch.float32):
        ids = _ids(g, m, top_k, list(experts))
        if sentinels and m > 3:
            ids[0, 1] = E  # the expert-parallel sentinel
            ids[2, 0] = -1  # an invalid id
            ids[3, 0] = 1000
        if m > 4 and top_k > 1:
            ids[4, 1] = ids[4, 0]  # one expert in two slots
        x = torch.randn((m, H), generator=g).to(hidden_dtype)
        return {"x": x, "ids": ids, "w": torch.rand((m, top_k), generator=g)}

    default = ("contiguous", None)
    # even split where it divides, uneven otherwise (7 experts)
    cases["f32"] = {**floats(torch.float32), **tokens(2), "placement": default}
    # a rank owning no experts where world > 2; bf16 hidden states
    counts = {1: [7], 2: [1, 6], 4: [3, 0, 2, 2]}[world]
    cases["bf16"] = {
        **floats(torch.bfloat16),
        **tokens(2, hidden_dtype=torch.bfloat16),
        "placement": ("contiguous", counts),
    }
    # every token's experts on rank 0: the other ranks compute nothing
    rank0 = ExpertPlacement.contiguous(E, world).local_experts(0)
    cases["one_rank"] = {**floats(torch.float32, split=True), **tokens(2, rank0, False), "placement": default}
    owners = [(3 * e + 1) % world for e in range(E)]
    cases["map"] = {**floats(torch.float32), **tokens(3), "placement": ("map", owners)}
    cases["q4_0"] = {**blocks(routemm.q4_0), **tokens(2), "placement": default, "ggml_type": "q4_0"}
    # the local experts on the automatic route (exact=False): within its tolerance, not bit for bit
    cases["f32_auto"] = {**floats(torch.float32), **tokens(2), "placement": ("map", owners), "exact": False}
    cases["q8_0"] = {**blocks(routemm.q8_0), **tokens(2), "placement": ("map", owners), "ggml_type": "q8_0"}
    return cases


def _placement(spec, world: int) -> ExpertPlacement:
    kind, arg = spec
    if kind == "map":
        return ExpertPlacement.from_map(arg, world)
    return ExpertPlacement.contiguous(E, world, arg)


def _init(rank: int, world: int, port: int, timeout_s: float) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))


def _run_cases(rank: int, world: int, port: int, tmp: str) -> None:
    _init(rank, world, port, CASE_TIMEOUT_S)
    try:
        cases = torch.load(os.path.join(tmp, "cases.pt"))
        outputs = {}
        for name, c in cases.items():
            placement = _placement(c["placement"], world)
            local = list(placement.local_experts(rank))
            lo = sum(SPLITS[world][:rank])
            hi = lo + SPLITS[world][rank]
            stacks = {k: c[k][local] for k in ("gate_up", "down", "up") if k in c}
            outputs[name] = ep_moe_experts(
                c["x"][lo:hi], c["ids"][lo:hi], c["w"][lo:hi], stacks["gate_up"], stacks["down"],
                placement=placement, up=stacks.get("up"), ggml_type=c.get("ggml_type"), exact=c.get("exact", True),
            )  # fmt: skip
            if not c.get("exact", True):
                continue
            top_k = int(c["ids"].shape[1])
            for tag, capacity in (("cap", max(SPLITS[world]) * top_k), ("cap1", 1)):
                outputs[f"{name}@{tag}"] = ep_moe_experts(
                    c["x"][lo:hi], c["ids"][lo:hi], c["w"][lo:hi], stacks["gate_up"], stacks["down"],
                    placement=placement, up=stacks.get("up"), ggml_type=c.get("ggml_type"), capacity=capacity,
                )  # fmt: skip
                outputs[f"{name}@{tag}_dropped"] = ep_capacity_dropped(c["ids"][lo:hi], placement, capacity)
        if world == 1:
            outputs["refusals"] = _refusals(cases["f32"])
            outputs["host_reads"] = _host_reads(cases["f32"])
        torch.save(outputs, os.path.join(tmp, f"out{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _refusals(c) -> list:
    """(name, error type, message, collectives run) of wrong calls inside a group of one rank: each
    must raise before any collective (on more ranks, its peers would wait for it)."""
    placement = ExpertPlacement.contiguous(E, 1)

    def call(x=c["x"], ids=c["ids"], w=c["w"], gate_up=c["gate_up"], down=c["down"], **kw):
        kw.setdefault("placement", placement)
        return ep_moe_experts(x, ids, w, gate_up, down, **kw)

    calls = {
        "world": lambda: call(placement=ExpertPlacement.contiguous(E, 2)),
        "local": lambda: call(gate_up=c["gate_up"][:3]),
        "placement": lambda: call(placement=[0] * E),
        "ids": lambda: call(ids=c["ids"][:2]),
        "float_ids": lambda: call(ids=c["ids"].float()),
        "top_k": lambda: call(ids=c["ids"][:, :0], w=c["w"][:, :0]),
        "stack_width": lambda: call(down=c["down"][:, :, : I // 2].contiguous()),
        "stack_dtype": lambda: call(down=c["down"].double()),
        "ggml_type": lambda: call(ggml_type="q3_k"),
        "exact": lambda: call(exact=1),
        "capacity": lambda: call(capacity=0),
        "capacity_type": lambda: call(capacity=2.0),
    }
    collectives = []
    real = dist.all_to_all_single
    dist.all_to_all_single = lambda *a, **k: (collectives.append(1), real(*a, **k))[1]
    out = []
    try:
        for name, run in calls.items():
            before = len(collectives)
            try:
                run()
                out.append((name, None, "", len(collectives) - before))
            except Exception as e:  # the type is the check
                out.append((name, type(e).__name__, str(e), len(collectives) - before))
        # no gradient: a backward through the result is refused by name, not silently absent
        y = call(x=c["x"].clone().requires_grad_())
        try:
            y.sum().backward()
            out.append(("backward", None, "", 0))
        except Exception as e:  # the type is the check
            out.append(("backward", type(e).__name__, str(e), 0))
    finally:
        dist.all_to_all_single = real
    return out


def _host_reads(c) -> dict:
    """The tensor methods that bring a value to the host (a sync a CUDA graph cannot hold) called
    during one call of each variant in a group of one rank."""
    names = ("tolist", "item", "numpy", "__bool__", "__int__", "__float__", "__index__")
    real = {n: getattr(torch.Tensor, n) for n in names}
    seen = []

    def recorder(name):
        def read(self, *a, **k):
            seen.append(name)
            return real[name](self, *a, **k)

        return read

    placement = ExpertPlacement.contiguous(E, 1)
    out = {}
    try:
        for n in names:
            setattr(torch.Tensor, n, recorder(n))
        for name, capacity in (("counts", None), ("capacity", 4)):
            seen.clear()
            ep_moe_experts(c["x"], c["ids"], c["w"], c["gate_up"], c["down"], placement=placement, capacity=capacity)
            out[name] = list(seen)
    finally:
        for n in names:
            setattr(torch.Tensor, n, real[n])
    return out


def _dropped(ids: torch.Tensor, placement: ExpertPlacement, capacity: int) -> torch.Tensor:
    """The capacity policy in plain Python: per destination rank, the first `capacity` valid
    (token, slot) pairs in (token, slot) order are kept, the rest dropped."""
    sent = [0] * placement.world_size
    dropped = torch.zeros(ids.shape, dtype=torch.bool)
    for t in range(ids.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            if 0 <= e < placement.n_experts:
                owner = placement.owners[e]
                dropped[t, s] = sent[owner] >= capacity
                sent[owner] += 1
    return dropped


def _run_raise(rank: int, world: int, port: int, tmp: str) -> None:
    """Rank 1 raises before the block and stays alive for LINGER_S (as a server that caught the
    error would), so its peers see no closed connection: the others call the block and must fail
    by the group's timeout, not hang."""
    _init(rank, world, port, RAISE_TIMEOUT_S)
    start = time.monotonic()
    outcome = {"rank": rank}
    try:
        if rank == 1:
            raise ValueError("rank 1 fails before the experts block")
        x = torch.randn((3, H))
        ids = torch.zeros((3, 2), dtype=torch.int64)
        ids[:, 1] = E - 1  # the last expert lives on the last rank
        placement = ExpertPlacement.contiguous(E, world)
        local = len(placement.local_experts(rank))
        ep_moe_experts(
            x, ids, torch.ones((3, 2)), torch.zeros((local, 2 * I, H)), torch.zeros((local, H, I)),
            placement=placement,
        )  # fmt: skip
        outcome["error"] = None
    except Exception as e:  # what each rank saw is the test's subject
        outcome["error"] = type(e).__name__
        outcome["message"] = "".join(traceback.format_exception_only(type(e), e))[-500:]
    outcome["seconds"] = time.monotonic() - start
    with open(os.path.join(tmp, f"raise{rank}.json"), "w") as f:
        json.dump(outcome, f)
    if rank == 1:  # alive until the others have failed, LINGER_S at most
        others = [os.path.join(tmp, f"raise{r}.json") for r in range(world) if r != 1]
        while time.monotonic() - start < LINGER_S and not all(os.path.exists(o) for o in others):
            time.sleep(0.05)
    else:
        dist.destroy_process_group()


def _spawn(fn, world: int, tmp: str, limit_s: float) -> None:
    """torch.multiprocessing.spawn without join's shortcut (it ends the other ranks as soon as one
    fails): every rank gets `limit_s` to end by itself; one still running is killed and fails the test."""
    context = mp.spawn(fn, args=(world, _free_port(), tmp), nprocs=world, join=False)
    deadline = time.monotonic() + limit_s
    for p in context.processes:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [i for i, p in enumerate(context.processes) if p.is_alive()]
    for i in hung:
        context.processes[i].kill()
    assert not hung, f"ranks {hung} still running after {limit_s} s"
    codes = [p.exitcode for p in context.processes]
    assert codes == [0] * world, f"ranks' exit codes {codes} (their errors are on stderr)"


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(bits), b.view(bits))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ep_moe_experts_bit_identical_to_one_process(tmp_path, world):
    cases = _cases(world)
    torch.save(cases, tmp_path / "cases.pt")
    _spawn(_run_cases, world, str(tmp_path), 120)
    outs = [torch.load(tmp_path / f"out{r}.pt") for r in range(world)]
    for name, c in cases.items():
        ref = torch.ops.routemm.moe_experts(
            c["x"], c["ids"], c["w"], c["gate_up"], c["down"], c.get("up"), c.get("ggml_type"), exact=True
        )
        parts = [o[name] for o in outs]
        assert [p.shape[0] for p in parts] == SPLITS[world], name
        got = torch.cat(parts)
        assert torch.isfinite(ref.float()).all() and ref.abs().sum() > 0, name
        if c.get("exact", True):
            assert _same_bits(got, ref), f"{name}: max |diff| {(got.float() - ref.float()).abs().max()}"
        else:
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, msg=name)
            continue
        # The fixed-capacity variant: under capacity the same bits; at capacity 1 the dropped slots
        # (the policy, in plain Python per rank) contribute nothing, as sentinel ids.
        placement = _placement(c["placement"], world)
        assert not torch.cat([o[f"{name}@cap_dropped"] for o in outs]).any(), name
        assert _same_bits(torch.cat([o[f"{name}@cap"] for o in outs]), ref), f"{name} at capacity"
        bounds = np.cumsum([0] + SPLITS[world])
        dropped = torch.cat(
            [_dropped(c["ids"][lo:hi], placement, 1) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]
        )
        assert torch.equal(torch.cat([o[f"{name}@cap1_dropped"] for o in outs]), dropped), name
        assert dropped.any(), name  # the case drops slots
        ids = c["ids"].masked_fill(dropped, E)
        ref1 = torch.ops.routemm.moe_experts(
            c["x"], ids, c["w"], c["gate_up"], c["down"], c.get("up"), c.get("ggml_type"), exact=True
        )
        assert _same_bits(torch.cat([o[f"{name}@cap1"] for o in outs]), ref1), f"{name} at capacity 1"
    if world == 1:
        refusals = {name: (kind, message, n) for name, kind, message, n in outs[0]["refusals"]}
        expected = {
            "world": ("InvalidArgumentError", "placement is for 2 ranks"),
            "local": ("InvalidArgumentError", "gate_up must hold rank 0's 7 local experts"),
            "placement": ("InvalidArgumentTypeError", "placement must be an ExpertPlacement"),
            "ids": ("InvalidArgumentError", "top_k_index must be [m = 6, top_k]"),
            "float_ids": ("InvalidArgumentError", "top_k_index must be integers"),
            "top_k": ("InvalidArgumentError", "top_k and H must be >= 1"),
            "stack_width": ("InvalidArgumentError", "moe_experts"),
            "stack_dtype": ("InvalidArgumentError", "moe_experts weight stacks must share one dtype"),
            "ggml_type": ("InvalidArgumentError", "ggml_type must be None or one of 'q4_0', 'q8_0', 'q4_1'"),
            "exact": ("InvalidArgumentTypeError", "ep_moe_experts exact must be a bool, got int"),
            "capacity": ("InvalidArgumentError", "ep_moe_experts capacity must be an int in [1, 2**32 - 1], got 0"),
            "capacity_type": ("InvalidArgumentError", "capacity must be an int in [1, 2**32 - 1], got 2.0"),
            "backward": ("UnsupportedError", "ep_moe_experts"),
        }
        wrong = {
            name: refusals[name]
            for name, (kind, text) in expected.items()
            if refusals[name][0] != kind or refusals[name][2] != 0 or text not in refusals[name][1]
        }
        assert not wrong, wrong  # name: (error type, message, collectives run before it)
        # The counts exchange reads the counts on the host; the fixed-capacity variant reads nothing.
        assert outs[0]["host_reads"]["counts"] and outs[0]["host_reads"]["capacity"] == [], outs[0]["host_reads"]


def test_a_rank_that_raises_makes_the_others_fail_within_the_timeout(tmp_path):
    world = 3
    _spawn(_run_raise, world, str(tmp_path), LINGER_S + 30)
    outcomes = [json.loads((tmp_path / f"raise{r}.json").read_text()) for r in range(world)]
    assert outcomes[1]["error"] == "ValueError"
    for o in (outcomes[0], outcomes[2]):
        assert o["error"] is not None, o  # the collective timed out: an error, never a hang
        assert o["seconds"] < LINGER_S - RAISE_TIMEOUT_S, o  # while rank 1 was still alive


def _run_from_gguf(rank: int, world: int, port: int, tmp: str) -> None:
    """Each rank loads its slice of every sample file's layer 1 and runs its experts expert
    parallel on its share of the tokens, the gate's ids and weights computed on the whole layer."""
    _init(rank, world, port, CASE_TIMEOUT_S)
    try:
        out = {}
        for name in sorted(os.listdir(tmp)):
            if not name.endswith(".gguf"):
                continue
            path = os.path.join(tmp, name)
            layer = routemm.MoeLayer.from_gguf(path, 1, process_group=dist.group.WORLD)
            placement = ExpertPlacement.contiguous(layer.n_experts, world)
            gate, up, down = (torch.from_dlpack(b) for b in (layer.gate, layer.up, layer.down))
            data = torch.load(os.path.join(tmp, name + ".pt"))
            lo, hi = sum(SPLITS[world][:rank]), sum(SPLITS[world][: rank + 1])
            got = ep_moe_experts(
                data["x"][lo:hi], data["ids"][lo:hi], data["w"][lo:hi], gate, down, up=up,
                placement=placement, ggml_type=data["ggml_type"],
            )  # fmt: skip
            out[name] = {"stacks": [t.clone() for t in (gate, up, down)], "out": got, "range": layer.expert_range}
            for label in ("gate", "up", "down"):
                out[name][label + "_file_backed"] = getattr(layer, label).is_file_backed
            try:
                layer(data["x"][:1].numpy())
                out[name]["call"] = None
            except Exception as e:  # the type is the check
                out[name]["call"] = (type(e).__name__, str(e))
        torch.save(out, os.path.join(tmp, f"gguf{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_moe_layer_from_gguf_loads_only_the_ranks_slice(tmp_path, world):
    """MoeLayer.from_gguf(..., process_group=) holds the rank's contiguous share of the experts
    (ExpertPlacement.contiguous), as views of the file's bytes (per-expert tensors: only the local
    ones stacked), and ep_moe_experts over those slices gives the whole layer's experts' bits."""
    pytest.importorskip("gguf")
    from routemm.cli.main import main

    g = torch.Generator().manual_seed(world)
    files = {"qwen3moe", "mixtral"}
    for arch in files:
        path = tmp_path / f"{arch}.gguf"
        kind = "q4_0" if arch == "qwen3moe" else "f32"
        split = ["--split-experts"] if arch == "mixtral" else []  # one 2-D tensor per expert
        assert (
            main(["gguf-sample", str(path), "--arch", arch, "--type", kind, "--layers", "2", "--experts", "7", *split])
            == 0
        )
        whole = routemm.MoeLayer.from_gguf(path, 1)
        m = sum(SPLITS[world])
        x = torch.randn((m, whole.hidden), generator=g)
        ids = _ids(g, m, whole.top_k, range(whole.n_experts))
        w = torch.rand(ids.shape, generator=g)
        ggml = whole.ggml_type.value if whole.ggml_type else None
        torch.save({"x": x, "ids": ids, "w": w, "ggml_type": ggml}, str(path) + ".pt")
    _spawn(_run_from_gguf, world, str(tmp_path), 120)
    outs = [torch.load(tmp_path / f"gguf{r}.pt") for r in range(world)]
    for arch in files:
        name = f"{arch}.gguf"
        whole = routemm.MoeLayer.from_gguf(tmp_path / name, 1)
        stacks = [torch.from_dlpack(b) for b in (whole.gate, whole.up, whole.down)]
        placement = ExpertPlacement.contiguous(whole.n_experts, world)
        for r, o in enumerate(outs):
            local = list(placement.local_experts(r))
            assert o[name]["range"] == ((local[0] if local else 0), len(local)), (name, r)
            for got, full in zip(o[name]["stacks"], stacks, strict=True):
                assert torch.equal(got, full[local]), (name, r)
            # mapped views of the file's tensors where the file stacks its experts; Mixtral's
            # per-expert tensors are stacked from the local ones only
            assert o[name]["gate_file_backed"] is (arch == "qwen3moe"), (name, r)
            assert o[name]["call"][0] == "UnsupportedError" and "expert_range" in o[name]["call"][1]
        data = torch.load(tmp_path / (name + ".pt"))
        ref = torch.ops.routemm.moe_experts(
            data["x"], data["ids"], data["w"], stacks[0], stacks[2], stacks[1], data["ggml_type"], exact=True
        )
        assert _same_bits(torch.cat([o[name]["out"] for o in outs]), ref), name


def test_moe_layer_from_gguf_process_group_and_expert_range_refusals(tmp_path):
    pytest.importorskip("gguf")
    from routemm.cli.main import main

    path = tmp_path / "m.gguf"
    assert main(["gguf-sample", str(path), "--layers", "2", "--experts", "4"]) == 0
    with pytest.raises(
        routemm.InvalidArgumentTypeError, match="process_group must be a torch.distributed ProcessGroup"
    ):
        routemm.MoeLayer.from_gguf(path, 1, process_group="world")
    layer = routemm.MoeLayer.from_gguf(path, 1, process_group=None)  # the whole layer
    assert layer.expert_range is None and int(layer.gate.shape[0]) == 4
    with pytest.raises(routemm.InvalidArgumentError, match="expert_range must be a"):
        routemm.MoeLayer(layer.router, layer.gate, layer.up, layer.down, top_k=2, renormalize=True, expert_range=(3, 2))


_TRANSFORMERS_EP = ("all_reduce", "all_to_all")  # transformers' EP implementations (ep_implementation)


def _tiny_qwen3_moe(implementation: str):
    """A one-layer Qwen3-MoE of 8 experts (top 2), the same weights on every rank and call."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=8, num_experts_per_tok=2,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM._from_config(cfg, experts_implementation=implementation).float()


def _transformers_tokens(ep_implementation: str, rank: int) -> torch.Tensor:
    """A rank's batch of token ids: all_reduce needs every rank to hold the same batch, all_to_all
    gives each rank its own."""
    seed = 0 if ep_implementation == "all_reduce" else rank + 1
    return torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(seed))


def _run_transformers_ep(rank: int, world: int, port: int, tmp: str) -> None:
    """transformers' own expert-parallel plan (the model's base_model_ep_plan: experts sharded on
    dim 0, sentinel ids >= the local count for off-rank slots) applied to the model, with
    experts_implementation "routemm" and, as the peer, transformers' "eager"."""
    _init(rank, world, port, CASE_TIMEOUT_S)
    try:
        import routemm.integrations.transformers as rt
        from torch.distributed.device_mesh import init_device_mesh
        from transformers.distributed.expert_parallel import apply_expert_parallelism

        rt.register()
        ep_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
        out = {}
        for ep_implementation in _TRANSFORMERS_EP:
            if ep_implementation == "all_reduce":  # the EP group is the group sharing one batch
                tp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
            else:  # every rank its own batch
                tp_mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))["tp"]
            for implementation in ("routemm", "eager"):
                model = _tiny_qwen3_moe(implementation)
                names = dict(model.model.named_modules()) | dict(model.model.named_parameters())
                plan = {
                    name: style
                    for pattern, style in model.config.base_model_ep_plan.items()
                    for name in names
                    if re.fullmatch(pattern.replace(".", r"\.").replace("*", r"\d+"), name)
                }
                apply_expert_parallelism(model.model, ep_mesh, tp_mesh, plan, ep_implementation=ep_implementation)
                experts = model.model.layers[0].mlp.experts
                before = rt.calls()
                tokens = _transformers_tokens(ep_implementation, rank)
                logits = model(tokens).logits
                logits.float().square().mean().backward()
                grad = experts.gate_up_proj.grad
                out[(ep_implementation, implementation)] = {
                    "logits": logits.detach(),
                    "grad": grad.to_local() if hasattr(grad, "to_local") else grad,
                    "local_experts": experts.num_experts,
                    "routemm_calls": rt.calls() - before,
                }
        torch.save(out, os.path.join(tmp, f"hf{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_transformers_expert_parallel_plan_runs_routemm(tmp_path, world):
    """experts_implementation="routemm" under transformers' expert-parallel plan, both of its EP
    implementations: each rank's experts are its slice (num_experts the local count), off-rank
    slots come as sentinel ids, and the logits and the local experts' gradients match transformers'
    own eager experts under the same plan and the single-process model (their sums differ in order
    only)."""
    pytest.importorskip("transformers.distributed.expert_parallel")
    import routemm.integrations.transformers as rt

    rt.register()
    _spawn(_run_transformers_ep, world, str(tmp_path), 240)
    outs = [torch.load(tmp_path / f"hf{r}.pt") for r in range(world)]
    for ep_implementation in _TRANSFORMERS_EP:
        for rank, o in enumerate(outs):
            mine, eager = o[(ep_implementation, "routemm")], o[(ep_implementation, "eager")]
            assert mine["local_experts"] == 8 // world and mine["routemm_calls"] >= 1, (ep_implementation, rank)
            assert eager["routemm_calls"] == 0
            torch.testing.assert_close(mine["logits"], eager["logits"], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(mine["grad"], eager["grad"], rtol=1e-4, atol=1e-6)
            whole = _tiny_qwen3_moe("routemm")
            with torch.no_grad():
                ref = whole(_transformers_tokens(ep_implementation, rank)).logits
            torch.testing.assert_close(mine["logits"], ref, rtol=1e-5, atol=1e-5)


def test_expert_placement_contiguous_and_map():
    p = ExpertPlacement.contiguous(7, 3)
    assert [p.local_experts(r) for r in range(3)] == [(0, 1, 2), (3, 4), (5, 6)]
    p = ExpertPlacement.contiguous(5, 3, [0, 4, 1])
    assert [p.local_experts(r) for r in range(3)] == [(), (0, 1, 2, 3), (4,)]
    p = ExpertPlacement.from_map(torch.tensor([2, 0, 2, 1]), 3)
    assert p.owners == (2, 0, 2, 1) and p.n_experts == 4
    assert [p.local_experts(r) for r in range(3)] == [(1,), (3,), (0, 2)]
    owner, local = p._tables("cpu")
    assert owner.tolist() == [2, 0, 2, 1] and local.tolist() == [0, 0, 1, 0]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: ExpertPlacement.contiguous(7, 2, [3, 3]), "summing to n_experts = 7"),
        (lambda: ExpertPlacement.contiguous(7, 2, [8, -1]), "non-negative"),
        (lambda: ExpertPlacement.contiguous(7, 0), "world_size must be an int >= 1"),
        (lambda: ExpertPlacement.contiguous(0, 2), "n_experts must be an int >= 1"),
        (lambda: ExpertPlacement.from_map([0, 2], 2), "owner of expert 1 must be a rank in [0, 2), got 2"),
        (lambda: ExpertPlacement.from_map([0, -1], 2), "owner of expert 1"),
        (lambda: ExpertPlacement.from_map([0, True], 2), "owner of expert 1"),
        (lambda: ExpertPlacement.from_map([0, 1.0], 2), "owner of expert 1"),
        (lambda: ExpertPlacement.from_map([], 2), "1 to 2**32 - 1 experts"),
        (lambda: ExpertPlacement.contiguous(4, 2).local_experts(2), "rank must be in [0, 2)"),
    ],
)
def test_expert_placement_refusals(make, message):
    with pytest.raises(routemm.InvalidArgumentError, match=re.escape(message)):
        make()


def test_ep_moe_experts_refuses_without_a_process_group():
    assert not dist.is_initialized()
    x = torch.zeros((2, H))
    ids = torch.zeros((2, 1), dtype=torch.int64)
    with pytest.raises(routemm.InvalidArgumentError, match="initialised torch.distributed process group"):
        ep_moe_experts(
            x, ids, torch.ones((2, 1)), torch.zeros((E, 2 * I, H)), torch.zeros((E, H, I)),
            placement=ExpertPlacement.contiguous(E, 1),
        )  # fmt: skip


def test_tensor_moe_combine_is_the_blocks_combine():
    """moe_combine on tensors over each slot's expert row (the block with top_k 1 and weight 1.0)
    gives the block's bits; a slot with an invalid id adds nothing, whatever its row holds."""
    g = torch.Generator().manual_seed(5)
    m, top_k = 6, 3
    gate_up = torch.randn((E, 2 * I, H), generator=g) / H**0.5
    down = torch.randn((E, H, I), generator=g) / I**0.5
    x = torch.randn((m, H), generator=g)
    ids = _ids(g, m, top_k, range(E))
    ids[1, 2], ids[4, 0] = E, -3
    w = torch.randn((m, top_k), generator=g)
    ref = torch.ops.routemm.moe_experts(x, ids, w, gate_up, down, exact=True)
    flat = ids.reshape(-1, 1).clamp(0, E - 1)
    rows = torch.ops.routemm.moe_experts(
        x.repeat_interleave(top_k, 0), flat, torch.ones(flat.shape), gate_up, down, exact=True
    )
    invalid = ((ids < 0) | (ids >= E)).reshape(-1)
    rows[invalid] = float("nan")
    fw = _tensor_ops.framework("torch")
    assert _same_bits(_tensor_ops.moe_combine(fw, rows, w, ids, E), ref)
    assert _tensor_ops.moe_combine(fw, rows[:0], w[:0], ids[:0], E).shape == (0, H)


@pytest.mark.parametrize(
    "args, message",
    [
        (lambda r, w, i: (r[:-1], w, i, E), "rows has 17 rows, weights says m \\* top_k = 18"),
        (lambda r, w, i: (r, w.double(), i, E), "moe_combine weights must be float32"),
        (lambda r, w, i: (r, w, i.float(), E), "moe_combine ids must be integers"),
        (lambda r, w, i: (r, w, i[:, :2], E), "weights, ids \\[m, top_k\\]"),
        (lambda r, w, i: (r, w, i, 0), "n_experts must be an int in \\[1, 2\\*\\*32 - 1\\]"),
        (lambda r, w, i: (r, w, i, True), "n_experts must be an int"),
    ],
)
def test_tensor_moe_combine_refusals(args, message):
    rows, w, ids = torch.zeros((18, H)), torch.ones((6, 3)), torch.zeros((6, 3), dtype=torch.int32)
    with pytest.raises(routemm.InvalidArgumentError, match=message):
        _tensor_ops.moe_combine(_tensor_ops.framework("torch"), *args(rows, w, ids))
