"""The CPU backend's thread pool polls before it sleeps (ROUTEMM_CPU_SPIN_US, default 200): the knob
is recorded when set, bad values are refused, and results do not depend on it or on a pool with
more threads than the hardware (where polling is off). The pool's own contract (every index once,
errors, teardown while polling) is tests/cpp/test_thread_pool.cpp."""

from __future__ import annotations

import hashlib

from support import run_python

# A Q4_0 mat-vec and an expert-ID matmul big enough to spread over the pool's threads; prints the
# SHA-256 of both outputs' bytes and the knob as receipts record it.
CODE = """
import hashlib, numpy as np, routemm
from routemm import q4_0
dev = routemm.Device("cpu")
reg = routemm.KernelRegistry(dev)
rng = np.random.default_rng(3)
n, k = 1536, 1024
w = dev.from_numpy(q4_0.quantize(rng.standard_normal((n, k), dtype=np.float32)))
x = dev.from_numpy(rng.standard_normal((3, k), dtype=np.float32))
out = dev.alloc(3 * n * 4, routemm.DType.F32, [3, n])
e, en, ek, top = 16, 384, 512, 4
stack = dev.from_numpy(rng.standard_normal((e, en, ek), dtype=np.float32))
xe = dev.from_numpy(rng.standard_normal((5, ek), dtype=np.float32))
ids = dev.from_numpy(np.argsort(rng.random((5, e)), axis=1)[:, :top].astype(np.uint32))
oe = dev.alloc(5 * top * en * 4, routemm.DType.F32, [5 * top, en])
digest = hashlib.sha256()
for _ in range(3):
    enc = dev.command_encoder()
    routemm.quantized_matmul_ggml(enc, reg, x, w, out, routemm.GgmlQuantizedMatmulParams(3, n, k), routemm.GgmlRoutingPolicy())
    routemm.dense_matmul_id(enc, reg, stack, xe, ids, oe, None, routemm.DenseMatmulIdParams(5, en, ek, top, e, en * ek * 4))
    enc.commit_and_wait()
    digest.update(out.numpy().tobytes())
    digest.update(oe.numpy().tobytes())
print(digest.hexdigest(), routemm.env.non_default().get("ROUTEMM_CPU_SPIN_US"))
"""


def _run(**env: str):
    return run_python(CODE, unset=("ROUTEMM_CPU_SPIN_US", "ROUTEMM_CPU_THREADS"), **env)


def test_results_do_not_depend_on_polling_or_oversubscription():
    runs = {
        "default": _run(),
        "sleep at once": _run(ROUTEMM_CPU_SPIN_US="0"),
        "long polls": _run(ROUTEMM_CPU_SPIN_US="5000"),
        "oversubscribed": _run(ROUTEMM_CPU_THREADS="64"),
        "one thread": _run(ROUTEMM_CPU_THREADS="1"),
    }
    for label, run in runs.items():
        assert run.returncode == 0, (label, run.stderr)
    digests = {label: run.stdout.split()[0] for label, run in runs.items()}
    assert len(set(digests.values())) == 1, digests
    assert digests["default"] != hashlib.sha256().hexdigest()  # the outputs were hashed
    recorded = {label: run.stdout.split()[1] for label, run in runs.items()}
    assert recorded["default"] == "None" and recorded["oversubscribed"] == "None"
    assert recorded["sleep at once"] == "0" and recorded["long polls"] == "5000"


def test_bad_values_are_refused():
    for bad in ("x", "-1", "1000001", "2.5", " 7", "+7", "99999999999999999999"):
        run = _run(ROUTEMM_CPU_SPIN_US=bad)
        assert run.returncode != 0, bad
        assert f"ROUTEMM_CPU_SPIN_US must be an integer in [0, 1000000], got '{bad}'" in run.stderr, run.stderr
