"""The proxy's front door: bad input is refused cleanly, good input routes on exact ids.

Runs against the session's ``pd_cluster`` proxy (real vLLM P and D behind it).

* Every malformed request gets a 4xx with an OpenAI-style body
  ``{"error": {"message", "type", "param", "code"}}``, never a 5xx, a hang or an
  HTML page; afterwards ``/health`` answers 200 and a normal request through the
  same proxy still equals the co-located baseline.
* The token ids the router hashes into request keys (``PromptKeys.token_ids``,
  driven here through the proxy's own upstream client against the same engines) are
  exactly the ``prompt_token_ids`` vLLM reports for that request when it is sent
  through the proxy.  If they differed, every index lookup would miss.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import requests

from helpers import assert_same, chat_body, completion_body, post

from sessionkv_proxy.config import EngineConfig, ProxyConfig, Role
from sessionkv_proxy.engines import EnginePool
from sessionkv_proxy.index.memory import MemoryIndex
from sessionkv_proxy.router import Router
from sessionkv_proxy.upstream import UpstreamPool

pytestmark = pytest.mark.cluster

MAX_BODY_BYTES = 8 * 1024 * 1024   # ProxyConfig.max_body_bytes default
MAX_SESSION_ID_CHARS = 256          # ProxyConfig.max_session_id_chars default
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "system", "content": "you are the kato tool; answer in rimu. " * 4},
            {"role": "user", "content": "the vaqu is of zipe and dramon? " * 3}]


def _raw_post(proxy: str, path: str, data: bytes, headers: dict[str, str] | None = None
              ) -> requests.Response:
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    return requests.post(proxy + path, data=data, headers=hdrs, timeout=120)


def _assert_openai_error(resp: requests.Response, status: int | None = None,
                         param: str | None = None) -> dict:
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.text[:500])
    if status is not None:
        assert resp.status_code == status, (resp.status_code, resp.text[:500])
    assert resp.headers.get("Content-Type", "").startswith("application/json"), resp.headers
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert err["code"] is None or isinstance(err["code"], (str, int)), err
    if param is not None:
        assert err["param"] == param, err
    return err


def _assert_still_serving(cluster) -> None:
    health = requests.get(cluster.proxy + "/health", timeout=30)
    assert health.status_code == 200, health.text
    body = completion_body(cluster.model, "the kato is of rimu and senlo. " * 5, max_tokens=8)
    got = post(cluster.proxy, COMPLETIONS, body)
    base = post(cluster.colocated, COMPLETIONS, body)
    assert_same(got, base, "normal request after bad input")


# --------------------------------------------------------------------------- bad input
def _bad_bodies(model: str) -> list[tuple[str, str, bytes, int | None, str | None]]:
    """(case id, path, raw body, expected status or None for any 4xx, expected param)."""
    chat = {"model": model, "messages": MESSAGES, "max_tokens": 4}
    comp = {"model": model, "prompt": "the kato", "max_tokens": 4}
    enc = lambda o: json.dumps(o).encode()  # noqa: E731
    return [
        ("malformed-json-chat", CHAT, b'{"model": "x", "messages": [', 400, None),
        ("malformed-json-completion", COMPLETIONS, b"{not json}", 400, None),
        ("not-utf8", COMPLETIONS, b"\xff\xfe{\x00", 400, None),
        ("empty-body", CHAT, b"", 400, None),
        ("json-array-body", CHAT, enc([chat]), 400, None),
        ("unknown-model-chat", CHAT, enc(dict(chat, model="no-such-model")), 404, "model"),
        ("unknown-model-completion", COMPLETIONS, enc(dict(comp, model="gpt-9")), 404,
         "model"),
        ("model-number", COMPLETIONS, enc(dict(comp, model=42)), 400, "model"),
        ("max-tokens-string", COMPLETIONS, enc(dict(comp, max_tokens="x")), 400,
         "max_tokens"),
        ("max-tokens-fraction", COMPLETIONS, enc(dict(comp, max_tokens=2.5)), 400,
         "max_tokens"),
        ("max-tokens-negative", CHAT, enc(dict(chat, max_tokens=-3)), 400, "max_tokens"),
        ("stream-string", CHAT, enc(dict(chat, stream="maybe")), 400, "stream"),
        ("stream-number", COMPLETIONS, enc(dict(comp, stream=2)), 400, "stream"),
        ("messages-not-list", CHAT, enc(dict(chat, messages="hello")), 400, "messages"),
        ("messages-dict", CHAT, enc(dict(chat, messages={"role": "user"})), 400, "messages"),
        ("messages-empty", CHAT, enc(dict(chat, messages=[])), 400, "messages"),
        ("messages-of-strings", CHAT, enc(dict(chat, messages=["hi"])), 400, "messages"),
        ("prompt-number", COMPLETIONS, enc(dict(comp, prompt=42)), 400, "prompt"),
        ("client-kv-transfer-params", COMPLETIONS,
         enc(dict(comp, kv_transfer_params={"do_remote_prefill": True})), 400,
         "kv_transfer_params"),
        # vLLM also reads kv_transfer_params from vllm_xargs: the same door.
        ("xargs-kv-transfer-params", COMPLETIONS,
         enc(dict(comp, vllm_xargs={"kv_transfer_params": "x"})), 400,
         "kv_transfer_params"),
        ("xargs-kv-transfer-params-chat", CHAT,
         enc(dict(chat, vllm_xargs={"kv_transfer_params": ["a"]})), 400,
         "kv_transfer_params"),
        # Deeper than any JSON decoder here walks: a 400, not a 500.
        ("nested-100k", COMPLETIONS,
         enc(comp)[:-1] + b', "user": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400,
         None),
        ("nested-100k-chat", CHAT,
         enc(chat)[:-1] + b', "metadata": ' + b'{"a":' * 50_000 + b"1" + b"}" * 50_001,
         400, None),
    ]


@pytest.fixture(scope="module")
def cluster(pd_cluster):
    return pd_cluster


@pytest.mark.parametrize("case", range(len(_bad_bodies("m"))),
                         ids=[c[0] for c in _bad_bodies("m")])
def test_bad_body_gets_openai_error(cluster, case):
    name, path, data, status, param = _bad_bodies(cluster.model)[case]
    resp = _raw_post(cluster.proxy, path, data)
    err = _assert_openai_error(resp, status, param)
    print(f"{name}: {resp.status_code} {err}")


def test_bad_input_leaves_proxy_serving(cluster):
    """All bad bodies in a row, then health and a real request."""
    for _, path, data, _, _ in _bad_bodies(cluster.model):
        _assert_openai_error(_raw_post(cluster.proxy, path, data))
    _assert_still_serving(cluster)


# Values vLLM's pydantic models accept in lax mode, and what they mean there.
_ABSENT = object()   # the field left out of the request
LAX_CASES = {
    "no-model": ({"model": _ABSENT}, None),
    "model-null": ({"model": None}, None),
    "max-tokens-string": ({"max_tokens": "6"}, None),
    "max-tokens-float": ({"max_tokens": 6.0}, None),
    "max-tokens-string-1": ({"max_tokens": " 1 "}, "prefill_only"),
    "max-tokens-true": ({"max_tokens": True}, "prefill_only"),
    "stream-1": ({"stream": 1}, None),
    "stream-string-true": ({"stream": "True"}, None),
    "stream-string-no": ({"stream": "no"}, None),
    "stream-null": ({"stream": None}, None),
}


def _lax_body(model: str, path: str, change: dict) -> dict:
    base = (chat_body(model, MESSAGES, max_tokens=6) if path == CHAT else
            completion_body(model, "the kato is of rimu and senlo. " * 20, max_tokens=6))
    return {k: v for k, v in {**base, **change}.items() if v is not _ABSENT}


def _generation(resp: requests.Response):
    from helpers import parse_generation, parse_stream

    assert resp.status_code == 200, (resp.status_code, resp.text[:500])
    if resp.headers.get("Content-Type", "").startswith("text/event-stream"):
        return parse_stream(resp.text, dict(resp.headers))
    return parse_generation(resp.json(), dict(resp.headers))


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("case", sorted(LAX_CASES))
def test_values_vllm_reads_leniently_are_served_alike(cluster, case, path):
    """A request vLLM serves, with a value its pydantic models coerce ("6" tokens, a
    stream of "True", no model), is served through the proxy too, read the same way:
    the same stream or whole answer, token for token, and a max_tokens that reads as
    1 goes to P alone."""
    change, route = LAX_CASES[case]
    data = json.dumps(_lax_body(cluster.model, path, change)).encode()
    got = _raw_post(cluster.proxy, path, data)
    base = _raw_post(cluster.colocated, path, data)
    assert got.headers.get("Content-Type", "").split(";")[0] == \
        base.headers.get("Content-Type", "").split(";")[0]
    assert_same(_generation(got), _generation(base), case)
    if route is not None:
        assert got.headers.get("x-sessionkv-route") == route, dict(got.headers)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_oversized_body_gets_413(cluster, path):
    pad = "ka " * ((MAX_BODY_BYTES // 3) + 1024)
    body = ({"model": cluster.model, "messages": [{"role": "user", "content": pad}]}
            if path == CHAT else {"model": cluster.model, "prompt": pad})
    data = json.dumps(body).encode()
    assert len(data) > MAX_BODY_BYTES
    resp = _raw_post(cluster.proxy, path, data)
    err = _assert_openai_error(resp, 413)
    assert str(MAX_BODY_BYTES) in err["message"], err
    _assert_still_serving(cluster)


_TOO_LONG = "s" * (MAX_SESSION_ID_CHARS + 1)
_BAD_CHARS = "sess ion;<script>"


@pytest.mark.parametrize("where", ["prompt_cache_key", "X-Session-ID", "session_id"])
@pytest.mark.parametrize("value", [_TOO_LONG, _BAD_CHARS, ""], ids=["too-long", "bad-chars",
                                                                  "empty"])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_bad_session_id_gets_400(cluster, where, value, path):
    body = ({"model": cluster.model, "messages": MESSAGES, "max_tokens": 4} if path == CHAT
            else {"model": cluster.model, "prompt": "the kato", "max_tokens": 4})
    headers = {}
    if where == "X-Session-ID":
        headers[where] = value
    else:
        body[where] = value
    resp = _raw_post(cluster.proxy, path, json.dumps(body).encode(), headers)
    _assert_openai_error(resp, 400, param=where)


@pytest.mark.parametrize("where", ["prompt_cache_key", "session_id"])
def test_non_string_session_id_gets_400(cluster, where):
    body = {"model": cluster.model, "prompt": "the kato", "max_tokens": 4, where: 12345}
    _assert_openai_error(_raw_post(cluster.proxy, COMPLETIONS, json.dumps(body).encode()),
                         400, param=where)


def test_longest_valid_session_id_is_accepted(cluster):
    """The boundary: exactly the limit, every allowed character class, succeeds."""
    sid = ("Ab9._:@/+=-" * 30)[:MAX_SESSION_ID_CHARS]
    body = completion_body(cluster.model, "the kato is of rimu. " * 4, max_tokens=4,
                           prompt_cache_key=sid)
    got = post(cluster.proxy, COMPLETIONS, body)
    base = post(cluster.colocated, COMPLETIONS,
                {k: v for k, v in body.items() if k != "prompt_cache_key"})
    assert_same(got, base, "max-length session id")
    _assert_still_serving(cluster)


# --------------------------------------------------------------------------- token ids
async def _router_token_ids(cluster, body: dict, is_chat: bool) -> list[int] | None:
    """What the proxy's router would hash, from its own code against the same engines."""
    engines = ([EngineConfig(url=u, role=Role.PREFILL) for u in cluster.prefill]
               + [EngineConfig(url=u, role=Role.DECODE) for u in cluster.decode])
    config = ProxyConfig(engines=engines)
    index = MemoryIndex()
    upstream = UpstreamPool()
    router = Router(config, EnginePool.from_configs(config.engines), index, upstream)
    try:
        return await router.prompt_keys.token_ids(body, is_chat)
    finally:
        await upstream.close()
        await index.close()


CHAT_CASES = {
    "system-user": MESSAGES,
    "multi-turn": MESSAGES + [
        {"role": "assistant", "content": "rimu senlo <think>ka to</think> zipe. " * 3},
        {"role": "user", "content": "and the dramon?  Spaces\tand\nnewlines. "}],
}
COMPLETION_CASES = {
    "plain": "tool call result kato rimu senlo. " * 8,
    "unicode-and-specials": "<|im_start|>user\nzi pe — ünï 漢字 🙂 dra<|im_end|>\n  ",
}


@pytest.mark.parametrize("case", sorted(CHAT_CASES))
def test_chat_routing_ids_equal_engine_prompt_ids(cluster, case):
    body = chat_body(cluster.model, CHAT_CASES[case], max_tokens=4)
    routed = asyncio.run(_router_token_ids(cluster, body, is_chat=True))
    got = post(cluster.proxy, CHAT, body)
    engine_ids = got.raw.get("prompt_token_ids")
    assert engine_ids, f"engine returned no prompt_token_ids: {list(got.raw)}"
    assert routed == engine_ids, (f"router ids ({len(routed or [])}) != engine ids "
                                  f"({len(engine_ids)})")
    print(f"chat {case}: {len(engine_ids)} prompt tokens, router ids equal")


@pytest.mark.parametrize("case", sorted(COMPLETION_CASES))
def test_completion_routing_ids_equal_engine_prompt_ids(cluster, case):
    body = completion_body(cluster.model, COMPLETION_CASES[case], max_tokens=4)
    routed = asyncio.run(_router_token_ids(cluster, body, is_chat=False))
    got = post(cluster.proxy, COMPLETIONS, body)
    engine_ids = got.raw["choices"][0].get("prompt_token_ids")
    assert engine_ids, f"engine returned no prompt_token_ids: {got.raw['choices'][0]}"
    assert routed == engine_ids, (f"router ids ({len(routed or [])}) != engine ids "
                                  f"({len(engine_ids)})")
    print(f"completion {case}: {len(engine_ids)} prompt tokens, router ids equal")


@pytest.mark.parametrize("path, body", [
    ("/tokenize", {"prompt": "The sea is wide and grey."}),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi there"}],
                   "add_generation_prompt": True}),
    ("/tokenize", {"prompt": "abc", "return_token_strs": True}),
    ("/detokenize", {"tokens": [78, 880, 5, 17]}),
    ("/detokenize", {"tokens": "not a list"}),
    ("/tokenize", {}),
], ids=["prompt", "messages", "token-strs", "detokenize", "detokenize-bad", "empty"])
def test_tokenizer_utilities_answer_as_the_engine(cluster, path, body):
    """/tokenize and /detokenize are forwarded: the same status and body as vLLM's."""
    data = json.dumps(dict(body, model=cluster.model)).encode()
    got = _raw_post(cluster.proxy, path, data)
    base = _raw_post(cluster.colocated, path, data)
    assert got.status_code == base.status_code, (got.status_code, got.text, base.text)
    if base.status_code == 200:
        assert got.json() == base.json()
    else:
        assert got.json()["error"]["message"] == base.json()["error"]["message"]


# --------------------------------------------------------------------------- isolation
def test_answers_carry_no_engine_internals(cluster):
    """D's handle (engine id, NIXL address, block ids, hash chain, session, tenant)
    stays in the proxy: the client sees what the co-located server sends."""
    body = completion_body(cluster.model, "the kato is of rimu. " * 12, max_tokens=6,
                           session_id="no-internals")
    for _ in range(2):   # the second turn attaches the first's handle
        resp = requests.post(cluster.proxy + COMPLETIONS, json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        out = resp.json()
        assert out.get("kv_transfer_params") is None, out.get("kv_transfer_params")
        assert "remote_host" not in resp.text and "hash_chain" not in resp.text
    base = requests.post(cluster.colocated + COMPLETIONS, json=body, timeout=120).json()
    assert set(out) == set(base), (sorted(out), sorted(base))


def test_another_tenant_cannot_take_over_a_session_record(cluster):
    """The same session id under another cache_salt is another session: the owner's
    next turn still attaches its own handle."""
    sid = "tenant-isolation"
    owner_prompt = "the owner's conversation: the kato is of rimu. " * 10
    intruder_prompt = "someone else's words: the vaqu is of zipe. " * 10

    def turn(prompt: str, salt: str):
        body = completion_body(cluster.model, prompt, max_tokens=8, session_id=sid,
                               cache_salt=salt)
        got = post(cluster.proxy, COMPLETIONS, body)
        assert_same(got, post(cluster.colocated, COMPLETIONS, body), f"salt {salt}")
        return got

    first = turn(owner_prompt, "owner-salt")
    intruder = turn(intruder_prompt, "intruder-salt")
    assert intruder.headers["x-sessionkv-handle"] == "none"   # not the owner's handle
    second = turn(owner_prompt + first.text + " and then? ", "owner-salt")
    assert second.headers["x-sessionkv-handle"] == "attached", second.headers


@pytest.mark.parametrize("header", ["X-Session-ID", "X-Session-Affinity"])
def test_default_session_headers_name_the_conversation(cluster, header):
    body = completion_body(cluster.model, f"header drill {header}: the kato. " * 10,
                           max_tokens=6)
    sid = f"hdr-{header.lower()}"
    first = post(cluster.proxy, COMPLETIONS, body, headers={header: sid})
    assert first.headers["x-sessionkv-handle"] == "none"
    body2 = dict(body, prompt=body["prompt"] + first.text + " more. ")
    second = post(cluster.proxy, COMPLETIONS, body2, headers={header: sid})
    assert second.headers["x-sessionkv-handle"] == "attached", second.headers
    # A header that is not configured names nothing.
    plain = post(cluster.proxy, COMPLETIONS, body, headers={"X-Correlation-ID": sid})
    assert "x-sessionkv-handle" not in plain.headers

