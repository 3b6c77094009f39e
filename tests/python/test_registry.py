"""KernelRegistry: labels, identities, injected lookup failures, freeze protection, authority ids."""

from __future__ import annotations

import re

import pytest
import routemm
from support import validate

NAMES = routemm.DENSE_MATMUL_ID_PIPELINE_NAMES


def test_pipeline_names():
    assert len(NAMES) == 7 and len(set(NAMES)) == 7
    assert set(NAMES) == {f"dense_matmul_id_direct_{d}_f32" for d in ("f32", "f16", "bf16")} | {
        f"dense_matmul_id_grouped_{d}_f32" for d in ("f32", "f16", "bf16")
    } | {"dense_matmul_id_map_distinct"}


def test_registry_registers_every_pipeline(registry):
    assert set(NAMES) <= set(registry.kernel_names())
    for name in NAMES:
        assert registry.has_kernel(name)


@pytest.mark.parametrize("name", NAMES)
def test_labels_and_identities(registry, backend, name):
    plain = registry.get_pipeline(name)
    assert plain.label == name and plain.kernel_name == name
    spec = registry.get_pipeline(name, [(700, 1), (701, 1)])
    assert spec.label == f"{name}|700:i1|701:i1" and spec.kernel_name == name
    assert registry.get_pipeline(name, [(702, -3)]).label == f"{name}|702:i-3"
    assert plain.max_total_threads_per_threadgroup >= 256
    for pipeline in (plain, spec):
        ident = pipeline.identity
        validate(ident)
        assert ident.pipeline_label == pipeline.label and ident.kernel_name == name
        assert ident.backend == backend
        assert ident.origin
        assert re.fullmatch(r"[0-9a-f]{64}", ident.content_sha256)
        assert registry.pipeline_identity(pipeline.label) == ident
        assert routemm.PipelineIdentity.from_json(ident.to_json()) == ident


def test_pipeline_identity_errors(registry):
    with pytest.raises(routemm.KernelNotFoundError):
        registry.pipeline_identity("no_such_kernel")
    for bad in (f"{NAMES[0]}|700", f"{NAMES[0]}|700:x1", f"{NAMES[0]}|:i1", f"{NAMES[0]}|700:i"):
        with pytest.raises(routemm.InvalidArgumentError):
            registry.pipeline_identity(bad)


def test_unknown_kernel(registry):
    with pytest.raises(routemm.KernelNotFoundError, match="no_such_kernel"):
        registry.get_pipeline("no_such_kernel")


def test_injected_failure_is_one_shot(registry):
    name = "dense_matmul_id_grouped_f32_f32"
    registry.inject_next_pipeline_lookup_failure(name)
    registry.get_pipeline(NAMES[0])  # other names unaffected
    with pytest.raises(routemm.KernelNotFoundError, match=name):
        registry.get_pipeline(name)
    assert registry.get_pipeline(name).label == name
    # Cached pipelines are not a way around an armed failure.
    registry.inject_next_pipeline_lookup_failure(name)
    with pytest.raises(routemm.KernelNotFoundError, match=name):
        registry.get_pipeline(name)
    registry.get_pipeline(name)


def test_freeze_protection(device, registry):
    name = NAMES[0]
    assert registry.frozen_plan_id("dense_matmul_id") is None
    assert not registry.is_protected(name)
    registry.register_kernel_from(name, name)  # allowed before any freeze
    registry.register_kernel_from("my_alias", NAMES[1])
    assert registry.has_kernel("my_alias")
    with pytest.raises(routemm.InvalidArgumentError):
        registry.register_kernel_from("x", "no_such_source")

    registry.freeze_plan("dense_matmul_id", "plan-a", list(NAMES))
    assert registry.frozen_plan_id("dense_matmul_id") == "plan-a"
    for n in NAMES:
        assert registry.is_protected(n)
        with pytest.raises(routemm.InvalidArgumentError, match=n):
            registry.register_kernel_from(n, n)
    assert not registry.is_protected("my_alias")
    registry.register_kernel_from("my_alias", NAMES[2])  # unprotected names stay mutable

    registry.freeze_plan("dense_matmul_id", "plan-a", list(NAMES))  # idempotent
    with pytest.raises(routemm.InvalidArgumentError, match="already frozen"):
        registry.freeze_plan("dense_matmul_id", "plan-b", list(NAMES))
    assert registry.frozen_plan_id("dense_matmul_id") == "plan-a"
    assert registry.frozen_plan_id("dense_q4") is None

    other = routemm.KernelRegistry(device)  # protection is per registry
    assert not other.is_protected(name) and other.frozen_plan_id("dense_matmul_id") is None
    other.register_kernel_from(name, name)


def test_authority_ids_distinct(device):
    regs = [routemm.KernelRegistry(device) for _ in range(4)]
    ids = [r.authority_id for r in regs]
    assert len(set(ids)) == 4 and all(i >= 1 for i in ids)
    assert ids == sorted(ids)


def test_authority_ids_refuse_exhaustion_instead_of_wrapping(device):
    """The process-wide counter hands out ids up to 2^64 - 2 and then refuses to create a registry
    (the reference panics on checked_add): wrapping would give a new registry the id of an older
    one, and with it the older one's frozen plans' authority."""
    from routemm import _core

    saved = _core._swap_next_registry_authority_id(2**64 - 2)
    try:
        last = routemm.KernelRegistry(device)
        assert last.authority_id == 2**64 - 2
        for _ in range(2):  # refused each time, the counter left where it is
            with pytest.raises(routemm.Error, match=r"KernelRegistry: .*authority ids are exhausted"):
                routemm.KernelRegistry(device)
        assert _core._swap_next_registry_authority_id(2**64 - 1) == 2**64 - 1
    finally:
        _core._swap_next_registry_authority_id(saved)
    assert routemm.KernelRegistry(device).authority_id == saved


def test_identity_names_the_code_behind_a_name(registry):
    """Registering another kernel under a name changes the identity (its entry point), so plans and
    fingerprints see that the code behind the name changed."""
    name = "dense_matmul_id_grouped_f32_f32"
    before = registry.get_pipeline(name).identity
    assert before.entry_point == name and before.schema_version == 2
    registry.register_kernel_from(name, "dense_matmul_id_grouped_f16_f32")
    after = registry.get_pipeline(name).identity
    assert after.kernel_name == name and after.entry_point == "dense_matmul_id_grouped_f16_f32"
    assert after != before
