"""Engine kinds are adapters: one registry lookup, capabilities instead of names, and each adapter says
what it cannot run before anything starts."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from reference_impl.engine import DEFAULT_ENGINE, ENGINES, EngineRequest, engine_kind
from reference_impl.models.registry import load_model

REPO = Path(__file__).resolve().parents[1]


def test_unknown_engine_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="use one of embedded, vllm"):
        engine_kind("sglang")


def test_capabilities_say_what_each_engine_reports() -> None:
    embedded, vllm = engine_kind("embedded").capabilities, engine_kind("vllm").capabilities
    assert embedded.per_tensor_reports and not vllm.per_tensor_reports
    assert vllm.session_ends_on_error and not embedded.session_ends_on_error
    assert embedded.prompt_logprobs_honour_temperature and not vllm.prompt_logprobs_honour_temperature
    assert embedded.colocate and embedded.fault_hooks and not vllm.fault_hooks
    assert DEFAULT_ENGINE in ENGINES


def test_the_default_validation_refuses_colocate_without_the_capability() -> None:
    request = EngineRequest(load_model("qwen3"), "float32", colocate=True, logprobs=True, logprob_temperature=None)
    assert engine_kind("embedded").validate(request) is None
    assert "set colocate: false" in (engine_kind("vllm").validate(request) or "")


def test_no_engine_name_is_compared_outside_the_engine_package() -> None:
    """Outside `reference_impl/engine/`, code reads capabilities; engine names appear as data only."""
    names = set(ENGINES)
    offenders = []
    for path in [*REPO.glob("harness/**/*.py"), *REPO.glob("reference_impl/**/*.py")]:
        if "reference_impl/engine/" in path.as_posix():
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                consts = [c.value for c in ast.walk(node) if isinstance(c, ast.Constant)]
                if names & set(consts):
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not offenders


def test_vllm_tp_workers_get_cpu_groups_of_their_own() -> None:
    from reference_impl.engine.vllm.launcher import cpu_threads_bind

    assert cpu_threads_bind(2, [0, 1]) == "0|1"
    assert cpu_threads_bind(2, [4, 5, 6, 7, 8]) == "4,5|6,7"
    assert cpu_threads_bind(4, [0, 1]) == "nobind"
