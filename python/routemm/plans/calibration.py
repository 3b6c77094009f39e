"""The backend-neutral route-calibration engine shared by the frozen route plans.

A route plan is decided once per activation: every candidate route is first *proved* against the
compatibility (control) route on the caller's current weights -- a poison dispatch fills both
outputs and their guard elements with 0xFFFFFFFF, both routes run, a compare dispatch ORs status
bits per weight (spec §6.4 step 5) -- and only a coherent candidate is *timed*: 5 alternating
rounds, one submission each, summarised as p25/median/p75, and chosen only when its win is
material, stable and not contradicted by the GPU clock. Timing results are shared through a
process-wide cache keyed without weight identity; a cache hit still re-proves the current bytes.

This module holds the calibration engine both instantiations (dense_q4_plan, dense_matmul_id_plan)
use: the selection rule and its constants, distributions, the proof kernels, deadlines, submission
accounting, fingerprints, the process cache, progress reporting and versioned plan files. The plan
records, freezing, the frozen-plan store and reloading are in _route_plan.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import logging
import math
import os
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import numpy as np

from .. import _core
from ..core._core_api import DispatchKind, PipelineIdentity
from ..core._errors import CalibrationError, InvalidArgumentError

LOGGER = logging.getLogger("routemm.calibration")

CALIBRATION_SAMPLES = 5
MATERIAL_WIN_FRACTION = 0.05
GPU_CONTRARY_TOLERANCE = 0.02
GUARD_ELEMENTS = 16

POISON_PIPELINE = "routemm_calibration_poison_f32"
COMPARE_PIPELINE = "routemm_calibration_compare_f32"
PROOF_PIPELINES = (POISON_PIPELINE, COMPARE_PIPELINE)
POISON_BITS = 0xFFFFFFFF
AUX_THREADS = 256

# Status bits of the compare kernel (csrc/backend/common/calibration_params.h).
STATUS_CONTROL_UNWRITTEN = 1 << 0
STATUS_CONTROL_NON_FINITE = 1 << 1
STATUS_CANDIDATE_UNWRITTEN = 1 << 2
STATUS_CANDIDATE_NON_FINITE = 1 << 3
STATUS_MISMATCH = 1 << 4
STATUS_CONTROL_GUARD = 1 << 5
STATUS_CANDIDATE_GUARD = 1 << 6
STATUS_LABELS = {
    STATUS_CONTROL_UNWRITTEN: "control unwritten",
    STATUS_CONTROL_NON_FINITE: "control non-finite",
    STATUS_CANDIDATE_UNWRITTEN: "candidate unwritten",
    STATUS_CANDIDATE_NON_FINITE: "candidate non-finite",
    STATUS_MISMATCH: "mismatch",
    STATUS_CONTROL_GUARD: "control guard written",
    STATUS_CANDIDATE_GUARD: "candidate guard written",
}
STATUS_CONTROL_BITS = STATUS_CONTROL_UNWRITTEN | STATUS_CONTROL_NON_FINITE | STATUS_CONTROL_GUARD
STATUS_CANDIDATE_BITS = (
    STATUS_CANDIDATE_UNWRITTEN | STATUS_CANDIDATE_NON_FINITE | STATUS_MISMATCH | STATUS_CANDIDATE_GUARD
)
STATUS_KNOWN_BITS = STATUS_CONTROL_BITS | STATUS_CANDIDATE_BITS

_PARAMS = struct.Struct("<QQII")  # CalibrationKernelParams: 24 bytes


class BudgetExceeded(Exception):
    """The calibration deadline passed; the message is the decision's diagnostic."""


# ---- Timing statistics and the selection rule --------------------------------------------------


def distribution(samples: Iterable[float]) -> tuple[float, float, float, int]:
    """(p25, median, p75, n) of the samples: sorted s, p25 = s[(n-1)//4], median = s[n//2],
    p75 = s[(n-1)*3//4] (spec §6.4)."""
    s = sorted(float(x) for x in samples)
    n = len(s)
    if n == 0:
        raise InvalidArgumentError("calibration timing distribution needs at least one sample")
    return s[(n - 1) // 4], s[n // 2], s[(n - 1) * 3 // 4], n


class Verdict(enum.Enum):
    CANDIDATE_WINS = "candidate_wins"
    CONTROL_FASTEST = "control_fastest"  # candidate wall median >= control wall median
    NO_STABLE_WINNER = "no_stable_winner"  # faster, but not material, stable and GPU-consistent


def select_winner(control_wall, control_gpu, candidate_wall, candidate_gpu) -> Verdict:
    """The winner rule of spec §6.4 over distributions (objects with p25_us, median_us, p75_us).

    The candidate wins only if its wall median is at most 0.95x the control's (material), its wall
    p75 is below the control's wall p25 (stable), and its GPU median is at most 1.02x the control's
    (no contrary GPU evidence).
    """
    if candidate_wall.median_us >= control_wall.median_us:
        return Verdict.CONTROL_FASTEST
    material = candidate_wall.median_us <= (1.0 - MATERIAL_WIN_FRACTION) * control_wall.median_us
    stable = candidate_wall.p75_us < control_wall.p25_us
    no_contrary_gpu = candidate_gpu.median_us <= (1.0 + GPU_CONTRARY_TOLERANCE) * control_gpu.median_us
    return Verdict.CANDIDATE_WINS if material and stable and no_contrary_gpu else Verdict.NO_STABLE_WINNER


# A timing hook replaces measured values (the submission still happens and is counted):
#   timer(route_value: str, round_index: int, measured: (wall_us, gpu_us)) -> (wall_us, gpu_us)
Timer = Callable[[str, int, tuple[float, float]], tuple[float, float]]


def gpu_interval_us(start: float, end: float, what: str) -> float:
    """The GPU interval (end - start) of one submission in microseconds. A time that is not finite
    and positive is a CalibrationError naming `what`: it is never clamped into a number that a
    winner rule or a receipt would then trust (spec §2.1)."""
    us = (float(end) - float(start)) * 1e6
    if not math.isfinite(us) or us <= 0:
        raise CalibrationError(
            f"calibration GPU interval of {what} is not a finite positive time (start {start!r} s, end {end!r} s)"
        )
    return us


def timed_submission(device, encode: Callable[[Any], None], what: str = "a timing submission") -> tuple[float, float]:
    """One timing sample: wall clock from before the encoder exists to after the wait, and the
    backend's GPU interval of the submission, both in microseconds."""
    t0 = time.perf_counter()
    encoder = device.command_encoder()
    encode(encoder)
    start, end = encoder.commit_wait_with_gpu_time()
    wall = (time.perf_counter() - t0) * 1e6
    return wall, gpu_interval_us(start, end, what)


def alternating_timing(
    device,
    routes: tuple,
    deadline: "Deadline",
    encode: Callable[[Any, Any], None],
    counted: Callable[[Any], None],
    timer: Optional[Callable],
    what: str,
) -> dict:
    """CALIBRATION_SAMPLES rounds of one timed submission per route, the route order reversed every
    other round (so neither route always runs on a warmer machine): {route: (wall us, GPU us)}.

    `encode(encoder, route)` encodes a route; `counted(route)` runs after it and before the commit
    (submission accounting, so a budget stop still reports what ran); `timer(route_value, round,
    measured)` is the test hook that may replace a measurement. The deadline is checked before
    every submission (BudgetExceeded). `what` names the op in a bad-interval error."""
    samples = {route: ([], []) for route in routes}
    for r in range(CALIBRATION_SAMPLES):
        for route in routes if r % 2 == 0 else tuple(reversed(routes)):
            deadline.check("calibration deadline reached during timing")

            def submission(encoder, route=route):
                encode(encoder, route)
                counted(route)

            measured = timed_submission(device, submission, f"a {what}{route.value} timing submission")
            wall, gpu = timer(route.value, r, measured) if timer else measured
            samples[route][0].append(wall)
            samples[route][1].append(gpu)
    return samples


# ---- Deadline and submission accounting ---------------------------------------------------------


class Deadline:
    """Elapsed-time budget measured from `start()` (after case validation)."""

    def __init__(self, max_elapsed_ms: int, clock: Callable[[], float] = time.perf_counter):
        self.max_elapsed_ms = max_elapsed_ms
        self._clock = clock
        self._t0 = clock()

    def elapsed_ms(self) -> float:
        return (self._clock() - self._t0) * 1e3

    def expired(self) -> bool:
        return self.elapsed_ms() >= self.max_elapsed_ms

    def check(self, message: str) -> None:
        if self.expired():
            raise BudgetExceeded(message)


@dataclasses.dataclass
class Submissions:
    """Command-buffer submissions of one activation, counted immediately before each commit."""

    proof: int = 0
    timing: int = 0
    cleanup: int = 0

    @property
    def total(self) -> int:
        return self.proof + self.timing + self.cleanup


def cleanup_submission(device, counter: Submissions) -> None:
    """One empty submission so scratch released by calibration cannot leak into serving work."""
    encoder = device.command_encoder()
    counter.cleanup += 1
    encoder.commit_and_wait()


# ---- Proof kernels ------------------------------------------------------------------------------


# value(i) depends on i mod 257 and i mod 31 only, so the sequence repeats every 257 * 31 values.
PROOF_INPUT_PERIOD = 257 * 31
_proof_period: Optional[np.ndarray] = None


def proof_input(count: int) -> np.ndarray:
    """value(i) = ((29 i mod 257) - 128) / 251 + ((43 i mod 31) - 15) / 16381, as F32 (spec §6.4).

    One period is computed from the formula and tiled: a profile's inputs run to hundreds of millions
    of values, which the formula itself would take seconds to evaluate. Returns a fresh array."""
    global _proof_period
    if _proof_period is None:
        i = np.arange(PROOF_INPUT_PERIOD, dtype=np.int64)
        v = ((29 * i) % 257 - 128).astype(np.float64) / 251.0 + ((43 * i) % 31 - 15).astype(np.float64) / 16381.0
        _proof_period = v.astype(np.float32)
    return np.tile(_proof_period, -(-count // PROOF_INPUT_PERIOD))[:count]


class ProofScratch:
    """Device buffers one calibration reuses across its shapes, allocated on first use: per K width,
    the proof input of the longest declared M (an (m, k) input is the first m * k values, since the
    input pattern depends on the flat index only), and `outputs` F32 buffers of the largest guarded
    output, viewed per shape. Saves regenerating, copying and allocating per shape.

    `pattern(count)` gives the first `count` input values (default: proof_input) and `period` the
    length after which they repeat."""

    # Inputs are uploaded in copies of one host chunk of about 4 MB (a whole number of periods, so
    # every copy continues the sequence): hundreds of MB are never generated on the host.
    UPLOAD_BYTES = 4 << 20

    def __init__(
        self,
        device,
        rows_by_width: dict,
        outputs: int,
        max_elements: int,
        *,
        pattern=None,
        period: int = PROOF_INPUT_PERIOD,
    ):
        self._device, self._rows, self._count, self._max = device, dict(rows_by_width), outputs, max_elements
        self._pattern = pattern or proof_input
        self.upload_chunk = max(1, self.UPLOAD_BYTES // 4 // period) * period
        self._inputs: dict = {}
        self._outputs: list = []
        self._statuses = None

    def input(self, m: int, k: int):
        if k not in self._inputs:
            count = self._rows[k] * k
            buffer = self._device.alloc(count * 4, _core.DType.F32, [self._rows[k], k])
            chunk = self._pattern(min(count, self.upload_chunk)).view(np.uint8)
            for start in range(0, count, self.upload_chunk):
                n = min(self.upload_chunk, count - start)
                buffer.view(start * 4, n * 4, _core.DType.F32, [n])._write_bytes(chunk[: n * 4])
            self._inputs[k] = buffer
        if m > self._rows[k]:
            raise ValueError(f"proof input of {m} rows requested, {self._rows[k]} declared for k={k}")
        return self._inputs[k].view(0, m * k * 4, _core.DType.F32, [m, k])

    def statuses(self, count: int):
        """`count` zeroed U32 status words (one buffer per calibration, zeroed for every batch)."""
        if self._statuses is None or self._statuses.shape[0] < count:
            self._statuses = self._device.alloc(max(count, 16) * 4, _core.DType.U32, [max(count, 16)])
        words = self._statuses.view(0, count * 4, _core.DType.U32, [count])
        words._write_bytes(np.zeros(count * 4, np.uint8))
        return words

    def outputs(self, elements: int) -> list:
        if elements > self._max:
            raise ValueError(f"proof output of {elements} elements requested, {self._max} declared")
        if not self._outputs:
            self._outputs = [
                self._device.alloc(self._max * 4, _core.DType.F32, [self._max]) for _ in range(self._count)
            ]
        return [b.view(0, elements * 4, _core.DType.F32, [elements]) for b in self._outputs]


def status_text(bits: int) -> str:
    """'label, label (status=0x..)' for a status word."""
    labels = [label for bit, label in STATUS_LABELS.items() if bits & bit]
    return f"{', '.join(labels) or 'ok'} (status=0x{bits:02x})"


class ProofKernels:
    """The poison and compare pipelines of one registry (Threads dispatches over guarded elements)."""

    def __init__(self, registry):
        self.poison = registry.get_pipeline(POISON_PIPELINE)
        self.compare = registry.get_pipeline(COMPARE_PIPELINE)

    def identities(self) -> list[PipelineIdentity]:
        return [self.poison.identity, self.compare.identity]

    @staticmethod
    def _geometry(guarded: int):
        return (guarded, 1, 1), (min(guarded, AUX_THREADS), 1, 1)

    def encode_poison(self, encoder, control, candidate, logical: int, guarded: int) -> None:
        grid, threads = self._geometry(guarded)
        encoder.dispatch(
            self.poison,
            [(0, control), (1, candidate), (2, _PARAMS.pack(logical, guarded, 0, 0))],
            grid,
            threads,
            dispatch_kind=DispatchKind.THREADS,
        )

    def encode_compare(self, encoder, control, candidate, statuses, index: int, logical: int, guarded: int) -> None:
        grid, threads = self._geometry(guarded)
        encoder.dispatch(
            self.compare,
            [(0, control), (1, candidate), (2, statuses), (3, _PARAMS.pack(logical, guarded, index, 0))],
            grid,
            threads,
            dispatch_kind=DispatchKind.THREADS,
        )


# ---- Fingerprints -------------------------------------------------------------------------------


def sha256_hex(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p)
    return h.hexdigest()


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def pipeline_set_fingerprint(identities: Iterable[PipelineIdentity]) -> str:
    """SHA-256 hex of the JSON array of the identities sorted by pipeline label."""
    ids = sorted(identities, key=lambda i: i.pipeline_label)
    return sha256_hex(canonical_json([i.to_dict() for i in ids]).encode())


def build_fingerprint(domain: str, schema_version: int, identities: Iterable[PipelineIdentity]) -> tuple[str, str]:
    """(build fingerprint, pipeline-set fingerprint). The source part covers the library version,
    the plan schema version and the plan domain; the identity hashes cover the compiled code."""
    pset = pipeline_set_fingerprint(identities)
    source = sha256_hex(_core.version().encode(), struct.pack("<I", schema_version), domain.encode())
    return sha256_hex((source + pset).encode()), pset


# ---- Process cache ------------------------------------------------------------------------------


class ProcessCache:
    """Timing outcomes shared by every registry of this process, keyed without weight identity."""

    def __init__(self):
        self._lock = threading.Lock()
        self._cells: dict[Any, Any] = {}

    def get(self, key):
        with self._lock:
            return self._cells.get(key)

    def put(self, key, value) -> None:
        with self._lock:
            self._cells[key] = value

    def setdefault(self, key, value):
        with self._lock:
            return self._cells.setdefault(key, value)

    def evict(self, key) -> None:
        with self._lock:
            self._cells.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._cells.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._cells)


PROCESS_CACHE = ProcessCache()


# ---- Progress -----------------------------------------------------------------------------------


class Progress:
    """Progress over `total` steps: an optional callback(done, total, info) and a tqdm bar that only
    shows on a TTY (tqdm is optional)."""

    def __init__(self, total: int, desc: str, callback: Optional[Callable[[int, int, dict], None]] = None):
        self.total, self.done, self._callback = total, 0, callback
        self._bar = None
        try:
            if sys.stderr is not None and sys.stderr.isatty():
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=desc, leave=False)
        except Exception:  # tqdm missing or unusable: no bar
            self._bar = None

    def step(self, info: dict) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update(1)
        if self._callback is not None:
            self._callback(self.done, self.total, info)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


# ---- Plan files ---------------------------------------------------------------------------------

PLAN_FILE_FORMAT = "routemm-route-plan"
PLAN_FILE_VERSION = 1
# The keys write_plan_file writes; a file with any other is refused.
_PLAN_FILE_KEYS = {"format", "format_version", "kind", "validators", "plan", "receipt"}
PLAN_CACHE_DIR_KNOB = "ROUTEMM_PLAN_CACHE_DIR"
# Knobs that cannot change a plan's meaning and so do not invalidate plan files.
_NEUTRAL_KNOBS = {PLAN_CACHE_DIR_KNOB, "ROUTEMM_LOG_LEVEL", "ROUTEMM_TEST_BACKENDS"}


class PlanFileMismatch(InvalidArgumentError):
    """A saved plan file does not match this process (library, build, device, driver or knobs)."""


def plan_validators(device, build_fp: str) -> dict:
    """What must be equal for a saved plan to be reused."""
    from ..core import env

    return {
        "library_version": _core.version(),
        "build_fingerprint": build_fp,
        "backend": device.backend,
        "device_name": device.name,
        "device_registry_id": int(device.registry_id),
        "device_properties": {str(k): str(v) for k, v in dict(device.properties).items()},
        "knobs": {k: v for k, v in env.non_default().items() if k not in _NEUTRAL_KNOBS},
    }


def write_plan_file(path, kind: str, validators: dict, plan: dict, receipt: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "format": PLAN_FILE_FORMAT,
        "format_version": PLAN_FILE_VERSION,
        "kind": kind,
        "validators": validators,
        "plan": plan,
        "receipt": receipt,
    }
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, sort_keys=True, indent=1, allow_nan=False)
    os.replace(tmp, path)
    return path


def read_plan_file(path, kind: str, current: dict) -> tuple[dict, Optional[dict]]:
    """(plan, receipt or None) documents of a saved plan; PlanFileMismatch names the first
    validator that differs from `current`, and is also what any unreadable or malformed file raises."""
    from ..core import _schemas

    path = Path(path)
    try:
        doc = _schemas.parse(path.read_bytes(), f"route plan file {path}")
    except OSError as e:
        raise PlanFileMismatch(f"route plan file {path} cannot be read: {e}") from None
    except InvalidArgumentError as e:
        raise PlanFileMismatch(str(e)) from None
    if not isinstance(doc, dict) or doc.get("format") != PLAN_FILE_FORMAT:
        raise PlanFileMismatch(f"route plan file {path} is not a routemm route plan")
    unknown = sorted(set(doc) - _PLAN_FILE_KEYS)
    if unknown:
        raise PlanFileMismatch(f"route plan file {path} has unknown key(s) {', '.join(unknown)}")
    if doc.get("format_version") != PLAN_FILE_VERSION:
        raise PlanFileMismatch(
            f"route plan file {path} has format_version {doc.get('format_version')!r}, "
            f"this library reads {PLAN_FILE_VERSION}"
        )
    if doc.get("kind") != kind:
        raise PlanFileMismatch(f"route plan file {path} holds a {doc.get('kind')!r} plan, not {kind!r}")
    saved = doc.get("validators")
    if not isinstance(saved, dict):
        raise PlanFileMismatch(f"route plan file {path} has no validators")
    for name in sorted(set(saved) | set(current)):
        if saved.get(name) != current.get(name):
            raise PlanFileMismatch(
                f"route plan file {path} was made for a different setup: {name} was "
                f"{saved.get(name)!r}, now {current.get(name)!r}; recalibrate"
            )
    # Both are always written; the receipt is null when a plan was saved without one.
    plan, receipt = doc.get("plan"), doc.get("receipt", "missing")
    if not isinstance(plan, dict) or not (receipt is None or isinstance(receipt, dict)):
        raise PlanFileMismatch(f"route plan file {path} lacks its plan or holds a malformed receipt")
    return plan, receipt


def plan_cache_path(kind: str, key: Any) -> Optional[Path]:
    """Where ROUTEMM_PLAN_CACHE_DIR keeps the plan for `key` (None when the knob is unset)."""
    root = os.environ.get(PLAN_CACHE_DIR_KNOB, "").strip()
    if not root:
        return None
    return Path(root) / f"{kind}-{sha256_hex(canonical_json(key).encode())[:32]}.json"
