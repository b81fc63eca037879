"""The agent benchmark's client and conversation proxy against fake engines (no vLLM):
the reference run builds histories from its own answers, an arm re-sends exactly the
reference's prompts, and the conversation proxy hands D's handle to P next turn."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer


from agentload.client import NOT_FINISHED, run_workload
from agentload.workload import AgentConfig, agent_workload
from conversation_proxy import create_app


def fake_engine(seen: list, answer_offset: int = 0) -> web.Application:
    """Answers max_tokens tokens derived from the prompt; streams one token a chunk."""

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append({"body": body, "session": request.headers.get("X-Session-ID")})
        ids = [(sum(body["prompt"]) + i + answer_offset) % 900 + 16
               for i in range(body["max_tokens"])]
        tops = [{str(t): -0.5, "x": -1.0} for t in ids]
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(ids),
                 "prompt_tokens_details": {"cached_tokens": 7}}
        params = {"remote_block_ids": [len(seen)], "do_remote_decode": True}
        if not body.get("stream"):
            return web.json_response({"choices": [{"token_ids": ids, "text": "",
                                                   "logprobs": {"top_logprobs": tops}}],
                                      "usage": usage, "kv_transfer_params": params})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for t, top in zip(ids, tops):
            chunk = {"choices": [{"token_ids": [t], "logprobs": {"top_logprobs": [top]}}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


WORKLOAD = agent_workload(AgentConfig(sessions=2, steps=3, prefix_tokens=40, task_tokens=8,
                                      tool_output_tokens=10, output_tokens=6, think_tokens=2,
                                      tool_delay_s=0.01, strip_share=0.5, subagent_share=1.0,
                                      subagent_steps=1, stagger_s=0.01, seed=5))


def test_reference_then_arm_send_the_same_prompts():
    async def scenario():
        ref_seen, arm_seen = [], []
        async with TestServer(fake_engine(ref_seen)) as ref, \
                TestServer(fake_engine(arm_seen, answer_offset=1)) as arm:
            base_ref = str(ref.make_url("")).rstrip("/")
            base_arm = str(arm.make_url("")).rstrip("/")
            reference = await run_workload(WORKLOAD, lambda sid: base_ref, "m")
            outputs = {k: r.token_ids for k, r in reference.items()}
            got = await run_workload(WORKLOAD, lambda sid: base_arm, "m", reference=reference)
        return ref_seen, arm_seen, reference, outputs, got

    ref_seen, arm_seen, reference, outputs, got = asyncio.run(scenario())
    assert len(reference) == WORKLOAD.n_steps and all(r.error is None for r in reference.values())
    for key, r in reference.items():
        assert WORKLOAD.prompt(*key, outputs)[:5] and r.ttft_s is not None
        assert len(r.token_ids) == WORKLOAD.session(key[0]).steps[key[1]].max_tokens
        assert len(r.itl_s) == len(r.token_ids) - 1 and r.cached_tokens == 7
    # The arm answers differently, yet it re-sends the reference's histories.
    by_prompt = lambda seen: sorted(json.dumps(s["body"]["prompt"]) for s in seen)  # noqa: E731
    assert by_prompt(ref_seen) == by_prompt(arm_seen)
    assert all(got[k].token_ids != outputs[k] for k in got)
    assert {s["session"] for s in arm_seen} == {s.sid for s in WORKLOAD.sessions}
    for s in arm_seen:
        assert s["body"]["temperature"] == 0 and s["body"]["ignore_eos"] is True


def test_conversation_proxy_hands_d_handle_to_p_next_turn():
    async def scenario():
        p_seen, d_seen = [], []
        async with TestServer(fake_engine(p_seen)) as p, TestServer(fake_engine(d_seen)) as d:
            app = create_app([str(p.make_url("")).rstrip("/")],
                             [str(d.make_url("")).rstrip("/")])
            async with TestServer(app) as proxy:
                base = str(proxy.make_url("")).rstrip("/")
                one = agent_workload(AgentConfig(sessions=1, steps=3, prefix_tokens=40,
                                                 subagent_share=0.0, tool_delay_s=0.0,
                                                 output_tokens=5, seed=1))
                res = await run_workload(one, lambda sid: base, "m")
        return p_seen, d_seen, res

    p_seen, d_seen, res = asyncio.run(scenario())
    assert all(r.error is None and len(r.token_ids) == 5 for r in res.values())
    assert [s["body"]["max_tokens"] for s in p_seen] == [1, 1, 1]
    assert p_seen[0]["body"]["kv_transfer_params"]["remote_block_ids"] is None
    # Turns 2 and 3: P gets the handle D returned at the end of the previous turn.
    assert [s["body"]["kv_transfer_params"]["remote_block_ids"] for s in p_seen[1:]] == \
        [[1], [2]]
    assert all(s["body"]["stream"] is False for s in d_seen)


def test_a_run_past_its_cap_reports_its_unfinished_steps():
    # An engine that never answers the second step: the run ends at the cap, the
    # first steps count as done and every other step as not finished.
    async def stalling(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if len(body["prompt"]) > 60:   # every step after the first
            await asyncio.sleep(30)
        return await _answer(body, request)

    async def _answer(body, request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {"choices": [{"token_ids": [17] * body["max_tokens"]}]}
        await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def scenario():
        app = web.Application()
        app.router.add_post("/v1/completions", stalling)
        async with TestServer(app) as srv:
            base = str(srv.make_url("")).rstrip("/")
            return await run_workload(WORKLOAD, lambda sid: base, "m", cap_s=1.0)

    got = asyncio.run(scenario())
    assert set(got) == set(WORKLOAD.keys())
    first = {(s.sid, 0) for s in WORKLOAD.sessions if s.parent is None}
    assert all(got[k].error is None for k in first)
    assert all(got[k].error == NOT_FINISHED for k in set(got) - first)


def test_external_engines_file_is_checked_at_start(tmp_path):
    from sessionkv_bench.arms import load_external

    ok = {"coloc": {"engines": [{"url": "http://a:1"}, {"url": "http://b:1"}]},
          "ours": {"prefill": {"url": "http://p:1", "events": "tcp://p:2", "replay": "tcp://p:3"},
                   "decode": {"url": "http://d:1", "events": "tcp://d:2", "replay": "tcp://d:3",
                              "early": "tcp://d:4"},
                   "redis_url": "redis://r:6379/0"},
          "stock": {"prefill": {"url": "http://sp:1"}, "decode": {"url": "http://sd:1"}}}
    path = tmp_path / "engines.json"
    path.write_text(json.dumps(ok))
    got = load_external(str(path))
    assert got["ours"].decode.early == "tcp://d:4" and got["ours"].redis_url
    assert [e.url for e in got["coloc"].engines] == ["http://a:1", "http://b:1"]
    bad = [({"colo": {}}, "unknown cluster 'colo'"),
           ({"coloc": {"engines": [{"url": "http://a:1"}]}}, "coloc needs two engines"),
           ({"stock": {"prefill": {"url": "http://p:1"}}}, "stock needs prefill and decode"),
           ({"ours": {"prefill": {"url": "http://p:1"}, "decode": {"url": "http://d:1"}}},
            "ours.prefill needs events and replay"),
           ({"coloc": {"engines": [], "gpus": 2}}, "gpus")]
    for raw, why in bad:
        path.write_text(json.dumps(raw))
        with pytest.raises(SystemExit, match=why):
            load_external(str(path))


def test_chat_turns_streamed_or_not_give_ids_text_and_the_rendered_prompt():
    """The one client reads a chat engine's answers, streamed (deltas) and not (one
    message); an arm re-sends the reference's answers as text."""
    from agentload.chat import ChatConfig, chat_workload

    seen = []

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body)
        rendered = list(range(len(json.dumps(body["messages"])) % 50 + 10))
        ids, words = [11, 12, 13], ["a", "b", "c"]
        tops = [{"top_logprobs": [{"logprob": -0.1}, {"logprob": -2.0}]} for _ in ids]
        if not body["stream"]:
            return web.json_response({"prompt_token_ids": rendered, "choices": [{
                "message": {"content": "".join(words)}, "token_ids": ids,
                "logprobs": {"content": tops}}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        first = {"prompt_token_ids": rendered, "choices": [{"delta": {"role": "assistant"}}]}
        await resp.write(f"data: {json.dumps(first)}\n\n".encode())
        for t, w, top in zip(ids, words, tops):
            chunk = {"choices": [{"delta": {"content": w}, "token_ids": [t],
                                  "logprobs": {"content": [top]}}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    w = chat_workload(ChatConfig(sessions=2, turns=3, stream_share=0.5, subagent_share=1.0,
                                 subagent_turns=1, tool_delay_s=0.01, stagger_s=0.01, seed=3))

    async def scenario():
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        async with TestServer(app) as srv:
            base = str(srv.make_url("")).rstrip("/")
            ref = await run_workload(w, lambda sid: base, "m")
            got = await run_workload(w, lambda sid: base, "m", reference=ref)
        return ref, got

    ref, got = asyncio.run(scenario())
    assert set(ref) == set(w.keys()) and all(r.error is None for r in ref.values())
    for (sid, k), r in ref.items():
        assert r.text == "abc" and r.token_ids == [11, 12, 13] and r.prompt_token_ids
        assert r.top_logprobs == [[-0.1, -2.0]] * 3
        assert r.prompt_tokens == len(r.prompt_token_ids)
        streamed = w.session(sid).steps[k].stream
        assert (r.ttft_s is not None) == streamed and len(r.itl_s) == (2 if streamed else 0)
        assert got[(sid, k)].error is None and got[(sid, k)].prompt_tokens == r.prompt_tokens
    assert {b["stream"] for b in seen} == {True, False}
    later = [b for b in seen if len(b["messages"]) > 2]
    assert later and all(m["content"] in ("abc", "c", "bc") or m["role"] != "assistant"
                         for b in later for m in b["messages"])
