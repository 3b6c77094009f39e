#!/usr/bin/env bash
# Short device run for the tensor-core expert-ID routes: build (sm_90a), their tests on cuda, extra
# K/N-tail checks, a timing of grouped_tensor_{lowp,tf32} vs torch._grouped_mm on the three MoE
# shapes at m = 512 and 4096, and (SANITIZE=1) compute-sanitizer memcheck and racecheck on small
# cases. SKIP_BUILD=1 uses the installed build; SKIP_TESTS=1 skips the tests and tail checks.
set -u
source "$(dirname "$0")/device_common.sh"
[ "${SKIP_BUILD:-0}" = 1 ] || build_and_report "grouped_(tensor|wgmma)_kernel"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  stamp pytest
  ROUTEMM_TEST_BACKENDS=cuda timeout 120 python3 -m pytest tests/python/test_dense_matmul_id_tensor.py tests/python/test_dense_matmul_id_numerics.py tests/python/test_dense_matmul_id_capture_receipts.py -q -x -p no:cacheprovider -k "not q4" 2>&1 | tail -5 | tee "$OUT/pytest.txt"
fi
cat > /tmp/tails.py <<'PY'
import numpy as np, ml_dtypes, routemm, sys
dev = routemm.Device("cuda"); reg = routemm.KernelRegistry(dev)
rng = np.random.default_rng(1); R = routemm.DenseMatmulIdRoute; bad = 0
cases = [(100, 130, 72, 2, 4), (300, 136, 72, 4, 4), (700, 200, 264, 8, 16), (33, 7, 35, 6, 8), (64, 129, 40, 2, 8)]
if len(sys.argv) > 1: cases = cases[:2]
for (m, n, k, top_k, E) in cases:
  for dt, rd in [(np.float32, routemm.DType.F32), (np.float16, routemm.DType.F16), (ml_dtypes.bfloat16, routemm.DType.BF16)]:
    for route in ("grouped_tensor_tf32", "grouped_tensor_lowp"):
      if route.endswith("lowp") and dt is np.float32: continue
      w = (rng.standard_normal((E, n, k)) / np.sqrt(k)).astype(dt); x = rng.standard_normal((m, k)).astype(np.float32)
      ids = np.argsort(rng.random((m, E)), 1)[:, :top_k].astype(np.uint32); ids[0, 0] = 0xFFFFFFFF
      params = routemm.DenseMatmulIdParams(m, n, k, top_k, E, n * k * np.dtype(dt).itemsize, route=R(route))
      wb = dev.from_numpy(w.view(np.uint16), rd) if dt is not np.float32 else dev.from_numpy(w)
      out = dev.from_numpy(np.full((m * top_k, n), np.nan, np.float32)); sc = routemm.DenseMatmulIdScratch(dev, E, m)
      enc = dev.command_encoder(); routemm.dense_matmul_id(enc, reg, wb, dev.from_numpy(x), dev.from_numpy(ids), out, sc, params); enc.commit_and_wait()
      o = out.numpy(); ref = np.zeros_like(o, dtype=np.float64)
      for f, e in enumerate(ids.reshape(-1)):
        if e < E: ref[f] = w[e].astype(np.float64) @ x[f // top_k].astype(np.float64)
      err = np.linalg.norm(o - ref) / np.linalg.norm(ref); tol = 2e-3 if "tf32" in route else 1e-2
      ok = np.isfinite(o).all() and err <= tol; bad += not ok
      print("OK " if ok else "BAD", m, n, k, top_k, E, np.dtype(dt).name, route, f"{err:.2e}")
print("tails bad:", bad)
PY
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  stamp tails
  timeout 60 python3 /tmp/tails.py 2>&1 | tail -40 | tee -a "$OUT/tails.txt" | grep -E "BAD|bad|Error"
fi
cat > /tmp/tbench.py <<'PY'
import sys, math, statistics, torch, routemm
sys.path.insert(0, "bench"); import bench_cuda_dense_matmul_id as B
dev = routemm.Device("cuda"); reg = routemm.KernelRegistry(dev)
def ktimes(fn, n):
  import json, tempfile
  from torch.profiler import ProfilerActivity, profile
  fn(0); torch.cuda.synchronize()
  with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for i in range(n): fn(i + 1)
    torch.cuda.synchronize()
  with tempfile.NamedTemporaryFile(suffix=".json") as f:
    prof.export_chrome_trace(f.name); tr = json.load(open(f.name))
  evs = tr["traceEvents"] if isinstance(tr, dict) else tr
  split = {}
  for e in evs:
    if e.get("ph") == "X" and e.get("cat") == "kernel":
      nm = e["name"]
      key = ("map" if "map_count" in nm or "map_scatter" in nm else "convert" if "round_activation" in nm
             else "tensor" if "grouped_tensor" in nm or "grouped_wgmma" in nm else "other")
      split[key] = split.get(key, 0) + e["dur"] / 1e6 / n
  return sum(split.values()), split
shapes = sys.argv[1].split(","); ms = [int(v) for v in sys.argv[2].split(",")]
for name in shapes:
  c = B.SHAPES[name]; E, top_k, n, k = c["E"], c["top_k"], c["n"], c["k"]
  gen = torch.Generator(device="cuda"); gen.manual_seed(1)
  copies = max(1, math.ceil(400e6 / (E * n * k * 2)))
  stacks = [(torch.randn((E, n, k), device="cuda", generator=gen) * 0.02).to(torch.bfloat16) for _ in range(copies)]
  wb = [B.to_routemm(s, dev) for s in stacks]
  for m in ms:
    x = torch.randn((m, k), device="cuda", generator=gen); xb = B.to_routemm(x, dev)
    ids = [B.router_ids(gen, m, E, top_k) for _ in range(4)]; ib = [B.to_routemm(i, dev) for i in ids]
    out = torch.empty((m * top_k, n), device="cuda"); ob = B.to_routemm(out, dev); sc = routemm.DenseMatmulIdScratch(dev, E, m)
    flops = 2 * m * top_k * n * k; res = {}
    for route in ("grouped_tensor_lowp", "grouped_tensor_tf32"):
      params = routemm.DenseMatmulIdParams(m, n, k, top_k, E, n * k * 2, route=routemm.DenseMatmulIdRoute(route))
      def call(j, params=params):
        enc = dev.command_encoder(); routemm.dense_matmul_id(enc, reg, wb[j % copies], xb, ib[j % 4], ob, sc, params); enc.commit_and_wait()
      call(0); rows = torch.arange(0, m * top_k, max(1, m * top_k // 64), device="cuda")[:64]
      want = torch.einsum("snk,sk->sn", stacks[0][ids[0].reshape(-1).long()[rows]].float(), x[rows // top_k])
      err = float((out[rows] - want).norm() / want.norm())
      t, split = ktimes(call, 10)
      tt = split.get("tensor", float("nan"))
      print(f"{name:14s} m={m:5d} {route:20s} {t*1e6:9.1f} us {flops/t/1e12:7.1f} TFLOP/s | tensor kernel {tt*1e6:8.1f} us {flops/tt/1e12:7.1f} TFLOP/s, map {split.get('map', 0)*1e6:7.1f} us, convert {split.get('convert', 0)*1e6:6.1f} us | err {err:.1e}", flush=True)
    def gm(i):
      w = stacks[i % copies]; flat = ids[i % 4].reshape(-1); order = torch.argsort(flat, stable=True)
      offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
      r = torch._grouped_mm(x[order // top_k].to(torch.bfloat16), w.transpose(-2, -1), offs=offs)
      o2 = torch.empty((m * top_k, n), device="cuda"); o2[order] = r.float(); return o2
    t = B.kernel_time(gm, 10); print(f"{name:14s} m={m:5d} {'torch_grouped_mm':20s} {t*1e6:9.1f} us {flops/t/1e12:7.1f} TFLOP/s", flush=True)
  del stacks, wb; torch.cuda.empty_cache()
PY
stamp bench
timeout ${BENCH_T:-120} python3 /tmp/tbench.py ${SHAPES:-qwen3-30b-a3b,mixtral-8x7b,deepseek-v3} ${MS:-512,4096} 2>&1 | grep -v -i warn | tee -a "$OUT/bench.txt"
if [ "${SANITIZE:-0}" = 1 ]; then
  stamp sanitize
  timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 python3 /tmp/tails.py short > "$OUT/memcheck.txt" 2>&1; echo "memcheck exit $?" | tee -a "$OUT/memcheck.txt"
  tail -4 "$OUT/memcheck.txt"
  timeout 90 compute-sanitizer --tool racecheck --error-exitcode 9 python3 /tmp/tails.py short > "$OUT/racecheck.txt" 2>&1; echo "racecheck exit $?" | tee -a "$OUT/racecheck.txt"
  tail -4 "$OUT/racecheck.txt"
fi
stamp done
