"""The model provider against the scripted model: a real HTTP server and the real openai client."""

from __future__ import annotations

import json
import pickle
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from agentfast.runner.model import ChatModel, ModelError, ModelReply, OpenAIChatModel, model_from_spec
from agentfast.runner.snapshot import Message, ToolCall
from agentfast.runner.spec import MODEL_API_KEY_ENV, ModelSpec, ResolvedModelConfig
from agentfast.testing.scripted import ScriptedModelServer, load_script, parse_script

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup_order",
            "description": "Look an order up by id.",
            "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]},
        },
    }
]
USER = [
    Message(role="system", content="You are a support agent."),
    Message(role="user", content="I was charged twice for A-1042."),
]


def serve(doc: dict) -> ScriptedModelServer:
    server = ScriptedModelServer(parse_script(doc, name="t"))
    server.start()
    return server


@pytest.fixture
def refund():
    with ScriptedModelServer(load_script("refund")) as server:
        model = OpenAIChatModel(base_url=server.base_url, api_key="k", model="scripted-refund", max_retries=0)
        yield server, model
        model.close()


def after_turn(reply: ModelReply, results: list[str]) -> list[Message]:
    """The transcript after an assistant reply and one tool message per call."""
    out = [reply.message]
    for call, content in zip(reply.message.tool_calls, results):
        out.append(Message(role="tool", tool_call_id=call.id, name=call.name, content=content))
    return out


def test_plain_turn():
    server = serve({"model": "m", "turns": [{"content": "hello there", "usage": {"prompt_tokens": 7, "completion_tokens": 2}}]})
    try:
        with OpenAIChatModel(base_url=server.base_url, api_key="k", model="m", temperature=0.0) as model:
            assert isinstance(model, ChatModel)
            reply = model.complete(USER, [])
        assert reply.message == Message(role="assistant", content="hello there")
        assert reply.finish_reason == "stop"
        assert (reply.prompt_tokens, reply.completion_tokens, reply.total_tokens) == (7, 2, 9)
        body = server.requests[0]
        assert "tools" not in body  # only sent when non-empty
        assert body["temperature"] == 0.0 and body["model"] == "m"
        assert body["messages"] == [m.to_openai() for m in USER]
    finally:
        server.stop()


def test_refund_script_parallel_calls_in_order_with_raw_arguments(refund):
    server, model = refund
    r0 = model.complete(USER, TOOLS)
    assert r0.finish_reason == "tool_calls"
    assert r0.message.tool_calls == [ToolCall(id="call_1", name="lookup_order", arguments='{"order_id": "A-1042"}')]
    assert server.requests[0]["tools"] == TOOLS

    r1 = model.complete(USER + after_turn(r0, ['{"status": "charged twice"}']), TOOLS)
    calls = r1.message.tool_calls
    assert [(c.id, c.name) for c in calls] == [("call_1", "issue_refund"), ("call_2", "add_case_note")]
    assert calls[0].arguments == '{"order_id": "A-1042", "amount_cents": 4999, "reason": "duplicate charge"}'
    assert json.loads(calls[1].arguments) == {
        "order_id": "A-1042",
        "note": "Customer charged twice; refund of 4999 cents requested.",
    }
    # the request carried the assistant tool calls and tool results in the wire shape
    sent = server.requests[1]["messages"]
    assert sent[2]["tool_calls"][0]["function"] == {"name": "lookup_order", "arguments": '{"order_id": "A-1042"}'}
    assert sent[3] == {"role": "tool", "content": '{"status": "charged twice"}', "tool_call_id": "call_1"}

    r2 = model.complete(USER + after_turn(r0, ["{}"]) + after_turn(r1, ["ok", "ok"]), TOOLS)
    assert r2.finish_reason == "stop" and not r2.message.tool_calls
    assert "A-1042" in r2.message.content and "$49.99" in r2.message.content


def test_usage_from_response_explicit_and_estimated(refund):
    _, model = refund
    r0 = model.complete(USER, TOOLS)
    assert (r0.prompt_tokens, r0.completion_tokens, r0.total_tokens) == (182, 21, 203)

    server = serve({"model": "m", "turns": [{"content": "x" * 40}]})
    try:
        with OpenAIChatModel(base_url=server.base_url, api_key="k", model="m") as m:
            a, b = m.complete(USER, TOOLS), m.complete(USER, TOOLS)
        assert a.prompt_tokens > 0 and a.completion_tokens >= 10
        assert a.total_tokens == a.prompt_tokens + a.completion_tokens
        assert (a.prompt_tokens, a.completion_tokens) == (b.prompt_tokens, b.completion_tokens)  # deterministic
    finally:
        server.stop()


def test_turn_selected_by_assistant_message_count(refund):
    server, model = refund
    first = model.complete(USER, TOOLS)
    again = model.complete(USER, TOOLS)  # a resumed process re-asking gets the same turn
    assert again.message == first.message
    # two assistant messages -> turn 2, whatever else the transcript holds
    transcript = USER + [Message(role="assistant", content="a"), Message(role="assistant", content="b")]
    assert model.complete(transcript, TOOLS).finish_reason == "stop"
    assert len(server.requests) == 3


def test_fail_statuses_are_retried_then_succeed():
    server = serve({"model": "m", "turns": [{"content": "finally", "fail": [429, 500]}]})
    try:
        with OpenAIChatModel(base_url=server.base_url, api_key="k", model="m", max_retries=4) as model:
            reply = model.complete(USER, [])
        assert reply.message.content == "finally"
        assert len(server.requests) == 3
    finally:
        server.stop()


def test_past_the_script_end_is_a_non_retriable_400(refund):
    server, model = refund
    transcript = USER + [Message(role="assistant", content=str(i)) for i in range(3)]
    with pytest.raises(ModelError) as exc:
        model.complete(transcript, TOOLS)
    err = exc.value
    assert err.retriable is False and err.status_code == 400
    assert "script 'refund' has 3 turns; the request asked for turn 4" in str(err)
    assert "not retriable" in str(err)
    assert len(server.requests) == 1  # 4xx is not retried
    assert pickle.loads(pickle.dumps(err)).retriable is False


def test_exhausted_retries_are_retriable():
    server = serve({"model": "m", "turns": [{"content": "never", "fail": [503, 503, 503]}]})
    try:
        with OpenAIChatModel(base_url=server.base_url, api_key="k", model="m", max_retries=1) as model:
            with pytest.raises(ModelError) as exc:
                model.complete(USER, [])
        assert exc.value.retriable is True and exc.value.status_code == 503
        assert "HTTP 503" in str(exc.value) and "gave up after 1 retries" in str(exc.value)
        assert str(exc.value).endswith("[retriable]")
        assert len(server.requests) == 2
    finally:
        server.stop()


def test_connection_refused_is_retriable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the with-block ends: nothing listens there
    with OpenAIChatModel(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", model="m", max_retries=0) as model:
        with pytest.raises(ModelError) as exc:
            model.complete(USER, [])
    assert exc.value.retriable is True and exc.value.status_code is None
    assert "could not connect" in str(exc.value)


def test_malformed_arguments_arrive_unchanged():
    spec = ModelSpec(name="scripted-malformed", script="malformed")
    model = model_from_spec(spec, env={})
    try:
        r0 = model.complete(USER, TOOLS)
        assert r0.message.tool_calls[0].arguments == '{"order_id": "A-1042"'
        r1 = model.complete(USER + after_turn(r0, ["error: arguments are not valid JSON"]), TOOLS)
        assert json.loads(r1.message.tool_calls[0].arguments) == {"order_id": "A-1042"}
        assert model.server.requests[0]["model"] == "scripted-malformed"
    finally:
        model.close()
    # closing the model stopped its server: nothing answers at that address any more
    with OpenAIChatModel(base_url=model.base_url, api_key="k", model="m", max_retries=0) as other:
        with pytest.raises(ModelError) as exc:
            other.complete(USER, [])
    assert exc.value.retriable is True


def _resolved(base_url: str, **spec) -> ResolvedModelConfig:
    return ResolvedModelConfig(name="llm", baseURL=base_url, models=["scripted-refund"], **spec)


def test_model_from_a_model_config_sends_its_key_and_limits_over_http():
    # Issue 12 item 4: the runner talks to the endpoint the run's ModelConfig names, with the key
    # the operator mounted (AGENTFAST_MODEL_API_KEY) as a Bearer token the server checks, and the
    # ModelConfig's limits; nothing else of the environment is read.
    doc = {"model": "scripted-refund", "turns": [{"content": "ok", "fail": [500, 500]}]}
    server = ScriptedModelServer(parse_script(doc, name="t"), api_key="sk-right")
    server.start()
    try:
        spec = ModelSpec(name="scripted-refund", config="llm")
        config = _resolved(
            server.base_url,
            apiKeySecretRef={"name": "llm-key", "key": "api-key"},
            timeoutSeconds=7,
            maxRetries=2,
            maxTokensPerRequest=321,
        )
        env = {MODEL_API_KEY_ENV: "sk-right", "OPENAI_API_KEY": "sk-wrong", "AGENTFAST_DSN": "postgresql://secret"}
        with model_from_spec(spec, config, env=env) as model:
            assert (model.base_url, model.timeout_s, model.max_retries, model.max_tokens) == (server.base_url, 7, 2, 321)
            reply = model.complete(USER, [])  # two 500s, retried twice (maxRetries), then the answer
        assert reply.message.content == "ok" and server.unauthorized == 0
        assert len(server.requests) == 3 and all(r["max_completion_tokens"] == 321 for r in server.requests)
        # a wrong key: the server's 401, not retried, not retriable
        with model_from_spec(spec, config, env={MODEL_API_KEY_ENV: "sk-wrong"}) as model:
            with pytest.raises(ModelError) as exc:
                model.complete(USER, [])
        assert exc.value.status_code == 401 and exc.value.retriable is False and server.unauthorized == 1
        # maxRetries applies: with 1 retry the scripted failures (a fresh server) outlast it
        fresh = ScriptedModelServer(parse_script(doc, name="t"), api_key="sk-right")
        fresh.start()
        try:
            with model_from_spec(
                spec,
                _resolved(fresh.base_url, apiKeySecretRef={"name": "k", "key": "k"}, maxRetries=1),
                env={MODEL_API_KEY_ENV: "sk-right"},
            ) as model:
                with pytest.raises(ModelError) as exc:
                    model.complete(USER, [])
            assert exc.value.status_code == 500 and exc.value.retriable is True and len(fresh.requests) == 2
        finally:
            fresh.stop()
    finally:
        server.stop()


def test_model_from_a_model_config_without_a_key_or_missing_its_key():
    spec = ModelSpec(name="scripted-refund", config="llm")
    with ScriptedModelServer(parse_script({"model": "m", "turns": [{"content": "hi"}]}, name="t")) as server:
        # no apiKeySecretRef (a local vLLM): no key needed, the placeholder is sent, the limits are the defaults
        with model_from_spec(spec, _resolved(server.base_url), env={}) as model:
            assert (model.timeout_s, model.max_retries, model.max_tokens) == (60.0, 4, None)
            assert model.complete(USER, []).message.content == "hi"
        assert "max_completion_tokens" not in server.requests[0]
    keyed = _resolved("http://127.0.0.1:9/v1", apiKeySecretRef={"name": "llm-key", "key": "api-key"})
    with pytest.raises(ModelError) as exc:
        model_from_spec(spec, keyed, env={"OPENAI_API_KEY": "sk-not-this-one"})
    assert exc.value.retriable is False and MODEL_API_KEY_ENV in str(exc.value) and "llm-key" in str(exc.value)
    with pytest.raises(ModelError, match="spec.model.config: ModelConfig 'llm' was not resolved"):
        model_from_spec(spec, None, env={MODEL_API_KEY_ENV: "k"})
    with pytest.raises(ModelError, match="spec.model.name: model 'gpt-5' is not one ModelConfig 'llm' allows"):
        model_from_spec(ModelSpec(name="gpt-5", config="llm"), keyed, env={MODEL_API_KEY_ENV: "k"})

    bad = ModelSpec(name="m", script="no-such-script")
    with pytest.raises(ModelError, match="no-such-script"):
        model_from_spec(bad, env={})


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ({"turns": [{"content": "x"}]}, "model: Field required"),
        ({"model": "m", "turns": []}, "turns: List should have at least 1 item"),
        (
            {"model": "m", "turns": [{"content": "a"}, {"usage": {"prompt_tokens": 1, "completion_tokens": 1}}]},
            "turns[1]: a turn needs content, tool_calls or refusal",
        ),
        (
            {"model": "m", "turns": [{"tool_calls": [{"id": "c", "arguments": {}}]}]},
            "turns[0].tool_calls[0].name: Field required",
        ),
        (
            {"model": "m", "turns": [{"tool_calls": [{"id": "c", "name": "n", "arguments": "{}"}]}]},
            "turns[0].tool_calls[0].arguments: must be a mapping",
        ),
        ({"model": "m", "turns": [{"content": "x", "fail": [200]}]}, "turns[0].fail: HTTP statuses must be 400-599"),
        ({"model": "m", "turns": [{"content": "x", "tool_call": []}]}, "turns[0].tool_call: Extra inputs are not permitted"),
    ],
)
def test_parse_script_errors_name_the_field(doc, field):
    with pytest.raises(ValueError) as exc:
        parse_script(doc, name="bad")
    assert field in str(exc.value) and "script 'bad'" in str(exc.value)


def test_load_script_files_and_errors(tmp_path: Path):
    p = tmp_path / "mine.yaml"
    p.write_text("model: m\nturns:\n  - content: hi\n    usage: {prompt_tokens: x, completion_tokens: 1}\n")
    with pytest.raises(ValueError, match=r"script 'mine': turns\[0\]\.usage\.prompt_tokens"):
        load_script(str(p))
    p.write_text("model: m\nturns:\n  - content: hi\n")
    assert load_script(str(p)).name == "mine"
    p.write_text("model: [unclosed\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_script(str(p))
    with pytest.raises(ValueError, match=r"bundled: .*refund"):
        load_script("nope")
    with pytest.raises(ValueError, match="cannot read"):
        load_script(str(tmp_path / "missing.yaml"))


def test_http_surface_models_and_404():
    with ScriptedModelServer(load_script("refund")) as server:
        with urllib.request.urlopen(server.base_url + "/models", timeout=5) as resp:
            body = json.load(resp)
        assert body["data"][0]["id"] == "scripted-refund"
        req = urllib.request.Request(server.base_url + "/embeddings", data=b"{}", method="POST")
        with pytest.raises(urllib.error.HTTPError) as exc:
            urllib.request.urlopen(req, timeout=5)
        assert exc.value.code == 404 and "error" in json.load(exc.value)


@pytest.mark.process
def test_module_serves_in_the_foreground():
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentfast.testing.scripted", "--script", "refund", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        url = line.rsplit(" ", 1)[-1].strip()
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1"), line
        with OpenAIChatModel(base_url=url, api_key="k", model="scripted-refund", max_retries=0) as model:
            assert model.complete(USER, TOOLS).message.tool_calls[0].name == "lookup_order"
        proc.terminate()
        assert proc.wait(timeout=5) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _varied_transcript() -> list[Message]:
    """Every message shape the runtime sends: text with quotes, newlines, non-ASCII and an emoji,
    an assistant with tool calls and no content (raw, malformed arguments), tool results, a refusal."""
    return USER + [
        Message(
            role="assistant",
            content=None,
            tool_calls=[
                ToolCall(id="call_1", name="lookup_order", arguments='{"order_id": "A-1042"}'),
                ToolCall(id="call_2", name="lookup_order", arguments='{"order_id": "A-10'),
            ],
        ),
        Message(
            role="tool",
            tool_call_id="call_1",
            name="lookup_order",
            content='{"status": "charged twice", "note": "Zoë \\"ok\\"\n€ 49,99 🧾"}',
        ),
        Message(role="tool", tool_call_id="call_2", name="lookup_order", content="error: arguments are not valid JSON"),
        Message(role="assistant", content="I cannot do that.", refusal="I cannot do that."),
        Message(role="user", content="Bitte prüfen — «noch einmal»\t\u2028"),
    ]


def _sdk_wire(
    server: ScriptedModelServer, model: OpenAIChatModel, messages: list[Message], tools: list[dict]
) -> tuple[dict, bytes]:
    """What the SDK's own ``chat.completions.create`` puts on the wire for this call (headers, body)."""
    model.client().chat.completions.create(**model.request_params(messages, tools))
    return server.wire[-1]


def test_the_wire_bytes_are_the_sdks_own_as_the_transcript_grows_and_changes():
    # Issue 15 item 4: complete() serialises each message once and posts the bytes itself; what
    # arrives must be byte for byte what chat.completions.create sends (same headers too).
    doc = {"model": "m", "turns": [{"content": f"turn {i}"} for i in range(8)]}
    with ScriptedModelServer(parse_script(doc, name="t"), keep_wire=64) as server:
        with OpenAIChatModel(
            base_url=server.base_url, api_key="k", model="m", temperature=0.25, max_tokens=77, max_retries=0
        ) as model:
            full = _varied_transcript()
            edited = full[:3] + [Message(role="tool", tool_call_id="call_1", name="lookup_order", content="edited")] + full[4:]
            # grows, grows again, a middle message replaced by another object, shrinks, no tools
            for messages, tools in [
                (full[:2], TOOLS),
                (full[:5], TOOLS),
                (full, TOOLS),
                (edited, TOOLS),
                (full[:4], TOOLS),
                (full, []),
            ]:
                reply = model.complete(messages, tools)
                ours_headers, ours = server.wire[-1]
                sdk_headers, sdk = _sdk_wire(server, model, messages, tools)
                assert ours == sdk, (len(messages), ours[:300], sdk[:300])
                assert ours_headers == sdk_headers
                assert json.loads(ours)["messages"] == [m.to_openai() for m in messages]
                assert reply.message.content == f"turn {sum(m.role == 'assistant' for m in messages)}"
            assert b'"content":"edited"' in server.wire[6][1]  # the replaced message was not served from the cache
            assert '"tools"' not in server.wire[-1][1].decode() and "Zoë" in server.wire[-1][1].decode("utf-8")


def test_a_retried_request_resends_the_same_bytes():
    server = ScriptedModelServer(
        parse_script({"model": "m", "turns": [{"content": "finally", "fail": [429, 502]}]}, name="t"), keep_wire=8
    )
    server.start()
    try:
        with OpenAIChatModel(base_url=server.base_url, api_key="k", model="m", max_retries=2) as model:
            assert model.complete(USER, TOOLS).message.content == "finally"
        bodies = [body for _, body in server.wire]
        assert len(bodies) == 3 and bodies[0] == bodies[1] == bodies[2]
        assert [h.get("x-stainless-retry-count") for h, _ in server.wire] == ["0", "1", "2"]
        assert [h.get("authorization") for h, _ in server.wire] == ["Bearer k"] * 3
    finally:
        server.stop()
