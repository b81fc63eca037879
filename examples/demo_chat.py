#!/usr/bin/env python3
"""An agent-like session through the proxy, printing where each turn's prompt KV came from.

    python examples/demo_chat.py --proxy http://127.0.0.1:8000 [--turns 6] [--stream]

Each turn re-sends the whole history as token ids (``/v1/completions``), as an agent
client that keeps ids does: the previous turns' prompts, the model's outputs, and a
new tool result.  The outputs' KV exists only on the D that generated them, so from
turn 2 on P pulls those blocks from D over NIXL instead of recomputing them.  On the
last turn the client strips the previous output from the history (as agent clients
strip a ``<think>`` block): D's blocks no longer match the prompt from there on, so
P's verification refuses them and P computes those tokens itself.

Per turn it prints the route (P then D, or D only) and, from P's token accounting:
prompt tokens, tokens computed, tokens reused from P's own prefix cache, tokens
pulled from D, and D's tokens refused by verification; then what D pulled back from
P, whether D continued from the token P sampled (first-token handoff; ``-`` when
streaming, where D's accounting is not sent), and P's decision for the blocks only
D held, with its priced pull and recompute times.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import urllib.request

_WORDS = ("kato rimu senlo vaqu zipe dramon elix orun shate bogal finu terwy the a is of "
          "and to in tool call result def return print").split()


def _post(url: str, body: dict) -> tuple[dict, dict[str, str]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        raw = resp.read()
        headers = {k.lower(): v for k, v in resp.headers.items()}
    if not body.get("stream"):
        return json.loads(raw), headers
    token_ids: list[int] = []
    for line in raw.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:]).get("choices", []):
                token_ids += choice.get("token_ids") or []
    return {"choices": [{"token_ids": token_ids}]}, headers


def _decision(prefill: dict) -> str:
    """P's choice for the blocks only D held (``d_to_p:pull:ok`` -> ``pull``), with
    the prices behind it; ``-`` when D held nothing P lacked."""
    decision = prefill.get("decision", "")
    if not decision.startswith("d_to_p:"):
        return "-"
    choice = decision.split(":")[1]
    pull, recompute = prefill.get("priced_pull_ms"), prefill.get("priced_recompute_ms")
    if pull is None or recompute is None:
        return choice
    return f"{choice} ({pull:.1f}/{recompute:.1f} ms)"


def _tokenize(proxy: str, model: str, text: str) -> list[int]:
    out, _ = _post(proxy + "/tokenize", {"model": model, "prompt": text,
                                          "add_special_tokens": False})
    return out["tokens"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--proxy", default="http://127.0.0.1:8000")
    p.add_argument("--turns", type=int, default=6,
                   help="turns; the last one strips the previous output (at least 3)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--stream", action="store_true")
    p.add_argument("--session", default="demo-session")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.turns < 3:
        p.error("--turns must be at least 3")
    rng = random.Random(args.seed)

    with urllib.request.urlopen(args.proxy + "/v1/models", timeout=30) as resp:
        model = json.loads(resp.read())["data"][0]["id"]
    history = _tokenize(args.proxy, model, " ".join(rng.choices(_WORDS, k=120)))
    print(f"{'turn':>4} {'route':<14} {'prompt':>6} {'computed':>8} {'local':>6} "
          f"{'from D':>6} {'refused':>7} {'D pulled':>8} {'D from P token':>14} "
          f"{'P decision':<16} (tokens)")
    last_output: list[int] = []
    pulled_turns = refused_turns = 0
    for turn in range(1, args.turns + 1):
        tool_result = _tokenize(args.proxy, model, " ".join(rng.choices(_WORDS, k=60)))
        stripped = turn == args.turns
        if stripped:  # drop the previous output, as a client strips its reasoning
            history = history[:len(history) - len(last_output)]
        history = history + tool_result
        body = {"model": model, "prompt": history, "max_tokens": args.max_tokens,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                "stream": args.stream, "prompt_cache_key": args.session}
        out, headers = _post(args.proxy + "/v1/completions", body)
        prefill = json.loads(headers.get("x-sessionkv-prefill", "{}"))
        decode = json.loads(headers.get("x-sessionkv-decode", "{}"))
        first = prefill or decode
        from_d = first.get("pulled_from_peer_tokens", 0) if prefill else 0
        refused = first.get("refused_by_verification_tokens", 0) if prefill else 0
        pulled_turns += from_d > 0
        refused_turns += refused > 0
        print(f"{turn:>4} {headers.get('x-sessionkv-route', '?'):<14} "
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
