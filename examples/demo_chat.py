#!/usr/bin/env python3
"""A coding-agent chat session through the proxy, printing where each turn's prompt KV
came from.

    python examples/demo_chat.py --proxy http://127.0.0.1:8000 [--turns 6] [--token-ids]

**Chat mode** (the default; a real instruct model, as ``ci/demo.sh`` serves it): the
client sends OpenAI chat messages in text, as coding agents and chat apps do.  A
system prompt and tools in the request, a task, tool results, the model's answers kept
in the history, every other turn streamed; on the next-to-last turn the client trims
the previous answer to its last line.  Each turn the engines render the template
again and tokenize the history again.  The previous answers' KV exists only on the D
that generated them: P pulls those blocks from D when they still match the new prompt
(and when pulling is priced cheaper than computing), computes what they do not cover,
and verification refuses D's blocks where the re-sent text no longer matches (the
trimmed answer, or an answer that tokenizes differently from the ids D generated).

**Token-id mode** (``--token-ids``; any model, e.g. the launcher's tiny one): each
turn re-sends the whole history as token ids (``/v1/completions``), as an agent client
that keeps ids does, and the last turn strips the previous output.

Per turn it prints the route (P then D, or D only), then from P's accounting: prompt
tokens, tokens computed, tokens from P's own prefix cache ("local"), tokens pulled from
D, D's tokens refused by verification, and P's decision for the blocks only D held
with its priced pull and recompute times; in chat mode a snippet of the answer, in
token-id mode what D pulled back from P and whether D continued from the token P
sampled.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import urllib.request

_WORDS = ("kato rimu senlo vaqu zipe dramon elix orun shate bogal finu terwy the a is of "
          "and to in tool call result def return print").split()

# The chat session: (user message, trim the previous answer to its last line first).
SYSTEM_PROMPT = ("You are a careful Python coding assistant working in a repository. Answer "
                 "briefly, with code when the user asks for code. Tool results arrive as "
                 "user messages that start with 'Tool result'.")
TOOLS = [{"type": "function", "function": {
    "name": "run_tests", "description": "Run the repository's unit tests.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}]
CHAT_TURNS = [
    ("Write a Python function is_palindrome(s) that says whether s reads the same "
     "backwards.", False),
    ("Tool result (run_tests tests/test_text.py): 4 passed. Now make it ignore case and "
     "spaces.", False),
    ("Tool result (run_tests tests/test_text.py): 1 failed: test_punctuation, "
     "is_palindrome('A man, a plan, a canal: Panama') returned False. Fix it.", False),
    ("Tool result (run_tests tests/test_text.py): 5 passed. Add a docstring.", False),
    ("Write one more test, for the empty string.", True),
    ("Summarize what we built in one sentence.", False),
]


def _post(url: str, body: dict, headers: dict[str, str] | None = None
          ) -> tuple[dict, dict[str, str]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          **(headers or {})})
    with urllib.request.urlopen(req, timeout=600) as resp:
        raw = resp.read()
        got_headers = {k.lower(): v for k, v in resp.headers.items()}
    if not body.get("stream"):
        return json.loads(raw), got_headers
    token_ids: list[int] = []
    text: list[str] = []
    for line in raw.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:]).get("choices", []):
                token_ids += choice.get("token_ids") or []
                text.append(choice.get("text") or
                            (choice.get("delta") or {}).get("content") or "")
    return {"choices": [{"token_ids": token_ids, "text": "".join(text)}]}, got_headers


def _decision(prefill: dict) -> str:
    """P's choice for the blocks only D held (``d_to_p:pull:ok`` -> ``pull``), with
    the prices behind it, or why there was nothing to price (``none
    (prefix_mismatch)``: D's blocks refused); ``-`` when D held nothing P lacked."""
    decision = prefill.get("decision", "")
    if not decision.startswith("d_to_p:"):
        return "-"
    parts = decision.split(":")
    choice = parts[1]
    if choice == "none" and len(parts) > 2:  # nothing to price, e.g. prefix_mismatch
        return f"none ({parts[2]})"
    pull, recompute = prefill.get("priced_pull_ms"), prefill.get("priced_recompute_ms")
    if pull is None or recompute is None:
        return choice
    return f"{choice} ({pull:.1f}/{recompute:.1f} ms)"


def _sources(headers: dict[str, str]) -> tuple[str, dict, dict]:
    """The route and P's and D's accounting from the proxy's headers (P's is empty on
    a turn served by D alone, and on a streamed turn whose first chunk D sent before
    P's answer reached the proxy; D's is sent only with non-streamed answers)."""
    prefill = json.loads(headers.get("x-sessionkv-prefill", "{}"))
    decode = json.loads(headers.get("x-sessionkv-decode", "{}"))
    return headers.get("x-sessionkv-route", "?"), prefill, decode


def _tokenize(proxy: str, model: str, text: str) -> list[int]:
    out, _ = _post(proxy + "/tokenize", {"model": model, "prompt": text,
                                          "add_special_tokens": False})
    return out["tokens"]


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else text


def _snippet(text: str, width: int = 60) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[:width - 3] + "..."


# What the tables' columns mean, printed above them.  P's columns are P's accounting of
# the turn's prompt (the proxy's x-sessionkv-prefill header), in tokens.
LEGEND = """\
route      disaggregated: P computed the prompt's KV, D decoded the answer from it;
           decode_only: D alone (P's columns then 0)
prompt     the prompt's tokens as P got them: the whole history each turn
local      found in P's own prefix cache (earlier turns' prompts P computed)
from D     pulled from the D that decoded earlier turns (only D held their answers' KV)
computed   computed by P; local + from D + computed = prompt
refused    D's tokens that verification refused (D's blocks did not hold this prompt's
           tokens), computed by P instead (counted in computed)
P decision for the blocks only D held: "pull (a/b ms)" pulled them, priced a ms to pull
           against b ms to compute; "recompute (a/b ms)" computed them, no dearer;
           "none (why)" nothing to price; "-" D held nothing P lacked"""
CHAT_LEGEND = LEGEND.replace("prompt     ", "stream     whether the answer was streamed\n"
                             "prompt     ", 1) + "\nanswer     the answer's start"
TOKEN_ID_LEGEND = LEGEND + """
D pulled   prompt tokens D pulled from P (the rest of its prompt D held already)
D from P token  yes: D continued from the token P sampled (first-token handoff)"""


def _print_legend(legend: str) -> None:
    print("Columns:")
    for line in legend.splitlines():
        print("  " + line)
    print()


def run_chat(proxy: str, model: str, turns: int, max_tokens: int, session: str) -> None:
    _print_legend(CHAT_LEGEND)
    print(f"{'turn':>4} {'route':<14} {'stream':<6} {'prompt':>6} {'local':>6} {'from D':>6} "
          f"{'computed':>8} {'refused':>7}  {'P decision':<22} answer")
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    totals = dict.fromkeys(("prompt", "local", "from_d", "computed", "refused"), 0)
    pulled_turns = refused_turns = 0
    for turn, (user, trim) in enumerate(CHAT_TURNS[:turns], 1):
        if trim:  # the client keeps only the last line of the previous answer
            messages[-1] = {"role": "assistant", "content": _last_line(messages[-1]["content"])}
        messages.append({"role": "user", "content": user})
        stream = turn % 2 == 0
        body = {"model": model, "messages": messages, "max_tokens": max_tokens,
                "temperature": 0, "stream": stream, "tools": TOOLS, "tool_choice": "none"}
        out, headers = _post(proxy + "/v1/chat/completions", body, {"X-Session-ID": session})
        choice = out["choices"][0]
        answer = choice["text"] if stream else (choice["message"]["content"] or "")
        route, prefill, _ = _sources(headers)
        row = {"prompt": prefill.get("prompt_tokens", 0),
               "local": prefill.get("local_hit_tokens", 0),
               "from_d": prefill.get("pulled_from_peer_tokens", 0),
               "computed": prefill.get("recomputed_tokens", 0),
               "refused": prefill.get("refused_by_verification_tokens", 0)}
        for key, value in row.items():
            totals[key] += value
        pulled_turns += row["from_d"] > 0
        refused_turns += row["refused"] > 0
        print(f"{turn:>4} {route:<14} {'yes' if stream else 'no':<6} {row['prompt']:>6} "
              f"{row['local']:>6} {row['from_d']:>6} {row['computed']:>8} {row['refused']:>7}"
              f"  {_decision(prefill):<22} {_snippet(answer)!r}"
              + ("  <- previous answer trimmed" if trim else ""))
        messages.append({"role": "assistant", "content": answer})
    print(f"P's prompt tokens over {turns} turns: {totals['prompt']}; from its own prefix "
          f"cache {totals['local']}, pulled from D {totals['from_d']}, computed "
          f"{totals['computed']}; D's blocks refused by verification: {totals['refused']} "
          f"tokens.")
    print(f"P pulled D's blocks on {pulled_turns} turn(s); verification refused D's blocks "
          f"on {refused_turns} turn(s).")


def run_token_ids(proxy: str, model: str, turns: int, max_tokens: int, stream: bool,
                  session: str, seed: int) -> None:
    rng = random.Random(seed)
    history = _tokenize(proxy, model, " ".join(rng.choices(_WORDS, k=120)))
    _print_legend(TOKEN_ID_LEGEND)
    print(f"{'turn':>4} {'route':<14} {'prompt':>6} {'computed':>8} {'local':>6} "
          f"{'from D':>6} {'refused':>7} {'D pulled':>8} {'D from P token':>14} "
          f"{'P decision':<16} (tokens)")
    last_output: list[int] = []
    pulled_turns = refused_turns = 0
    for turn in range(1, turns + 1):
        tool_result = _tokenize(proxy, model, " ".join(rng.choices(_WORDS, k=60)))
        stripped = turn == turns
        if stripped:  # drop the previous output, as a client strips its reasoning
            history = history[:len(history) - len(last_output)]
        history = history + tool_result
        body = {"model": model, "prompt": history, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                "stream": stream, "prompt_cache_key": session}
        out, headers = _post(proxy + "/v1/completions", body)
        route, prefill, decode = _sources(headers)
        first = prefill or decode
        from_d = first.get("pulled_from_peer_tokens", 0) if prefill else 0
        refused = first.get("refused_by_verification_tokens", 0) if prefill else 0
        pulled_turns += from_d > 0
        refused_turns += refused > 0
        print(f"{turn:>4} {route:<14} "
              f"{first.get('prompt_tokens', 0):>6} {first.get('recomputed_tokens', 0):>8} "
              f"{first.get('local_hit_tokens', 0):>6} {from_d:>6} {refused:>7} "
              f"{decode.get('pulled_from_peer_tokens', '-') if prefill and decode else '-':>8} "
              f"{('yes' if decode.get('first_token_from_prefill') else 'no') if decode else '-':>14} "
              f"{_decision(prefill):<16}"
              + ("  <- previous output stripped" if stripped else ""))
        last_output = out["choices"][0]["token_ids"]
        history = history + last_output
    print(f"P pulled D's blocks on {pulled_turns} turn(s); verification refused D's "
          f"blocks on {refused_turns} turn(s).")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--proxy", default="http://127.0.0.1:8000")
    p.add_argument("--token-ids", action="store_true",
                   help="re-send the history as token ids (/v1/completions) instead of "
                        "chat messages in text")
    p.add_argument("--turns", type=int, default=6,
                   help=f"turns (at least 3; chat mode at most {len(CHAT_TURNS)})")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--stream", action="store_true",
                   help="token-id mode: stream every turn (chat mode streams every other)")
    p.add_argument("--session", default="demo-session")
    p.add_argument("--seed", type=int, default=0, help="token-id mode's random text")
    args = p.parse_args(argv)
    if args.turns < 3:
        p.error("--turns must be at least 3")
    if not args.token_ids and args.turns > len(CHAT_TURNS):
        p.error(f"chat mode has {len(CHAT_TURNS)} turns")

    with urllib.request.urlopen(args.proxy + "/v1/models", timeout=30) as resp:
        model = json.loads(resp.read())["data"][0]["id"]
    if args.token_ids:
        run_token_ids(args.proxy, model, args.turns, args.max_tokens, args.stream,
                      args.session, args.seed)
    else:
        run_chat(args.proxy, model, args.turns, args.max_tokens, args.session)
    return 0


if __name__ == "__main__":
    sys.exit(main())
