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
    assert vllm.image_prompts_via_chat and not embedded.image_prompts_via_chat
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


def test_vllm_starts_vl_checkpoints_with_their_tokenizer_and_a_profile_image_of_the_prompts_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An adapter decision: a text checkpoint starts without tokenizer (token-id prompts), a VL one with its
    tokenizer and processors (the chat route) and vLLM's start-up encoder profile on one image of the fixed
    prompt's size (256 x 288 for the Qwen3-VL sizes) and no video."""
    import json

    from reference_impl.engine.vllm import launcher
    from reference_impl.models.checkpoint import make_checkpoint

    monkeypatch.setattr(launcher, "vllm_python", lambda: Path("/venv/bin/python"))
    vllm = engine_kind("vllm")
    text = vllm.server(str(make_checkpoint(load_model("qwen3"), 1234)), 1, "/tmp/x.log", "float32")
    vl = vllm.server(str(make_checkpoint(load_model("qwen3-vl"), 1234)), 1, "/tmp/x.log", "float32")
    assert "--skip-tokenizer-init" in text.command(1) and "--limit-mm-per-prompt" not in text.command(1)
    argv = vl.command(1)
    assert "--skip-tokenizer-init" not in argv
    limits = json.loads(argv[argv.index("--limit-mm-per-prompt") + 1])
    assert limits == {"image": {"count": 1, "width": 288, "height": 256}, "video": 0}
    assert "--no-mm-device-do-normalize" in argv  # dummy weights would leave a random on-device normalizer


@pytest.mark.parametrize("model", ["qwen3-vl", "qwen3-moe", "qwen3-vl-moe"])
def test_vllm_takes_vl_and_moe_models(monkeypatch: pytest.MonkeyPatch, model: str) -> None:
    from reference_impl.engine.vllm import env

    monkeypatch.setattr(env, "vllm_python", lambda: Path("/venv/bin/python"))
    request = EngineRequest(load_model(model), "float32", colocate=False, logprobs=True, logprob_temperature=1.0)
    assert engine_kind("vllm").validate(request) is None


def test_an_engine_actor_imports_no_torch() -> None:
    """An engine actor (`harness.placement.EngineActor`) only launches and watches a server: its module, the
    engine kinds, every model's registry entry and a server object of either kind come without torch,
    transformers or Megatron (importing torch would cost each actor about 3 s of CPU and 0.5 GB before its
    server even starts), and `cuda_available` still gives torch's answer. The checkpoint is made here; the
    child only reads it."""
    import json
    import subprocess
    import sys

    import torch

    from reference_impl.models.checkpoint import make_checkpoint

    ckpt = make_checkpoint(load_model("qwen3"), 1234)
    code = (
        "import sys, json\n"
        "import harness.placement\n"
        "from reference_impl.engine import ENGINES, engine_kind\n"
        "from reference_impl.models.registry import available_models, load_model\n"
        "[load_model(m) for m in available_models()]\n"
        f"[engine_kind(k).server({str(ckpt)!r}, 7, '/tmp/x.log', 'float32') for k in ENGINES]\n"
        "from reference_impl.cuda import cuda_available\n"
        "print(json.dumps([cuda_available(), sorted({m.split('.')[0] for m in sys.modules})]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    cuda, modules = json.loads(out.stdout.strip().splitlines()[-1])
    assert cuda == torch.cuda.is_available()  # the answer the trainer's ranks act on
    top = set(modules)
    assert "ray" in top and "reference_impl" in top
    heavy = top & {"torch", "transformers", "megatron", "vllm"}
    assert not heavy, heavy
