"""Chat prompts tokenized in the proxy, on two real vLLM engines.

Two plain vLLM servers on the test model, and the proxy (in-process, ``ProxyApp``)
with both as decode engines, so every request is routed on its content.

* With ``--tokenizer MODEL_DIR`` the start-up probes match the engines, and chat
  requests (system and user, several turns, content parts, tools, no generation
  prompt, continue the final message) reach the engines without one ``/tokenize``
  call (the engines' own ``http_requests_total{handler="/tokenize"}``).  The ids the
  router routes on equal the ids the engine prompted with (the answer's
  ``prompt_token_ids`` and ``usage.prompt_tokens``) and the engine's ``/tokenize``
  with ``messages``; the recent-routes credit holds their whole block chain for the
  engine that served the request.
  A request with its own ``chat_template``, which these engines refuse, goes to
  ``/tokenize`` and gets the engine's 400.
* A tokenizer directory whose chat template differs from the engines': the probe
  finds it, counts ``errors{kind="local_chat_template_mismatch"}``, chat requests go
  to ``/tokenize`` again (one call each), and the answer equals the engine's own.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import aiohttp
import pytest
import requests

from cluster import free_port_block
from helpers import chat_body

from sessionkv_proxy.app import ProxyApp, create_app
from sessionkv_proxy.config import load_config

from vllm_sessionkv.wire.hashing import request_keys

pytestmark = pytest.mark.cluster

BLOCK_SIZE = 64     # the session's plain engines' (conftest.PLAIN_BLOCK_SIZE)
# Long enough that every conversation below fills at least one block.
SYSTEM = {"role": "system", "content": "You answer in the words of the sea: ka to ri mu. The "
          "tide keeps the time, the gulls keep the count, and the shore keeps what the "
          "waves bring in."}
CONVERSATIONS = {
    "system_user": {"messages": [SYSTEM, {"role": "user", "content": "sen lo va qu zi?"}]},
    "multi_turn": {"messages": [SYSTEM, {"role": "user", "content": "pe dra mon?"},
                                {"role": "assistant", "content": "el ix or un sha."},
                                {"role": "user", "content": "te bo gal fi nu ter wy?"}]},
    "parts": {"messages": [SYSTEM, {"role": "user", "content": [
        {"type": "text", "text": "the tool result is"}, {"type": "text", "text": "ka to"}]}]},
    "tools": {"messages": [SYSTEM, {"role": "user", "content": "call it"},
                           {"role": "assistant", "content": "", "tool_calls": [
                               {"id": "c1", "type": "function",
                                "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
                           {"role": "tool", "tool_call_id": "c1", "content": "ri mu"}],
              "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                  "type": "object", "properties": {"x": {"type": "integer"}}}}}],
              "tool_choice": "none"},
    "no_generation_prompt": {"messages": [SYSTEM, {"role": "user", "content": "sen lo"}],
                             "add_generation_prompt": False},
    "continue_final": {"messages": [SYSTEM, {"role": "user", "content": "ka"},
                                    {"role": "assistant", "content": "to ri"}],
                       "add_generation_prompt": False, "continue_final_message": True},
}


@pytest.fixture(scope="module")
def two_engines(plain_engines) -> list[str]:
    assert all(spec.block_size == BLOCK_SIZE for spec in plain_engines.values())
    return [spec.url for spec in plain_engines.values()]


def tokenize_calls(engines: list[str]) -> float:
    """``/tokenize`` requests the engines served (vLLM's HTTP counter)."""
    total = 0.0
    for url in engines:
        text = requests.get(url + "/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith("http_requests_total{") and 'handler="/tokenize"' in line:
                total += float(line.rsplit(" ", 1)[1])
    return total


async def start_proxy(engines: list[str], tokenizer: str) -> tuple[ProxyApp, str]:
    port = free_port_block(1)
    config = load_config(None, {"engines": [{"url": u, "role": "decode"} for u in engines],
                                "tokenizer": tokenizer, "port": port,
                                "block_size": BLOCK_SIZE})
    app = create_app(config)
    await app.start()
    return app, f"http://127.0.0.1:{port}"


async def chat(http: aiohttp.ClientSession, url: str, body: dict) -> tuple[dict, dict]:
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json(), dict(resp.headers)


async def engine_tokenize(http: aiohttp.ClientSession, url: str, body: dict) -> list[int]:
    fields = {k: v for k, v in body.items() if k != "tool_choice"}
    async with http.post(url + "/tokenize", json={"model": None, **fields}) as resp:
        assert resp.status == 200, await resp.text()
        return (await resp.json())["tokens"]


async def test_chat_routes_on_ids_rendered_in_the_proxy(two_engines, tiny_model) -> None:
    app, proxy = await start_proxy(two_engines, tiny_model)
    router = app.services.router
    prompt_keys = router.prompt_keys
    try:
        assert prompt_keys.local_chat_ok, "the start-up probes should match the engines"
        calls_before = tokenize_calls(two_engines)
        served: dict[str, int] = {}
        routed: dict[str, list[int]] = {}
        async with aiohttp.ClientSession() as http:
            for name, conversation in CONVERSATIONS.items():
                body = chat_body(tiny_model, max_tokens=4, **conversation)
                # What the router routes this request on (the same call plan() makes).
                routed[name] = ids = await prompt_keys.token_ids(body, True)
                out, headers = await chat(http, proxy, body)
                assert out["prompt_token_ids"] == ids, name
                assert out["usage"]["prompt_tokens"] == len(ids), name
                engine = headers["x-sessionkv-decode-engine"]
                served[engine] = served.get(engine, 0) + 1
                keys = request_keys(ids, BLOCK_SIZE)
                assert keys and router.recent.overlaps(keys, time.time())[engine] == len(keys)
            assert tokenize_calls(two_engines) == calls_before, "a chat request asked /tokenize"
            # These engines refuse a request's own template (no
            # --trust-request-chat-template): the probe saw it, so such a request goes
            # to /tokenize and is refused as the engine refuses it.
            assert not prompt_keys.request_templates_ok
            body = chat_body(tiny_model, max_tokens=4, chat_template="{{ messages }}",
                             **CONVERSATIONS["system_user"])
            async with http.post(proxy + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 400, await resp.text()
            assert tokenize_calls(two_engines) == calls_before + 1
            # The engines' own chat tokenization agrees (asked after the count).
            for name, conversation in CONVERSATIONS.items():
                assert await engine_tokenize(http, two_engines[0], conversation) == routed[name]
        assert sum(served.values()) == len(CONVERSATIONS)
    finally:
        await app.stop(5.0)


def _other_template_dir(tiny_model: str, dest: Path) -> str:
    """The test model's tokenizer with a chat template the engines do not use."""
    dest.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(Path(tiny_model) / name, dest / name)
    template = (Path(tiny_model) / "chat_template.jinja").read_text()
    header = "<|im_start|>{{ message['role'] }}"
    (dest / "chat_template.jinja").write_text(template.replace(header + "\n", header + ":\n"))
    return str(dest)


def _errors(metrics_text: str, kind: str) -> float:
    match = re.search(r'^sessionkv_proxy_errors_total\{kind="%s"\} (\S+)$' % kind,
                      metrics_text, re.M)
    return float(match.group(1)) if match else 0.0


async def test_a_template_unlike_the_engines_is_counted_and_not_used(
        two_engines, tiny_model, tmp_path) -> None:
    app, proxy = await start_proxy(two_engines, _other_template_dir(tiny_model, tmp_path / "tok"))
    router = app.services.router
    prompt_keys = router.prompt_keys
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(proxy + "/metrics") as resp:
                metrics_text = await resp.text()
            assert _errors(metrics_text, "local_chat_template_mismatch") == 1
            assert prompt_keys.local_chat is None and prompt_keys.local_tokenizer_ok
            body = chat_body(tiny_model, max_tokens=8, **CONVERSATIONS["multi_turn"])
            calls_before = tokenize_calls(two_engines)
            out, headers = await chat(http, proxy, body)
            assert tokenize_calls(two_engines) == calls_before + 1   # back on /tokenize
            direct, _ = await chat(http, two_engines[0], body)
        assert out["prompt_token_ids"] == direct["prompt_token_ids"]
        assert (out["choices"][0]["token_ids"] == direct["choices"][0]["token_ids"]), \
            json.dumps([out["choices"][0], direct["choices"][0]])[:500]
        routed = await prompt_keys.token_ids(body, True)
        assert routed == direct["prompt_token_ids"]
    finally:
        await app.stop(5.0)
