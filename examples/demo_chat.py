#!/usr/bin/env python3
"""A multi-turn chat through the proxy, printing where each turn's prompt KV came from.

    python examples/demo_chat.py --proxy http://127.0.0.1:8000 [--turns 6] [--stream]

Per turn it prints the route (P then D, or D only), and from the connector's
accounting: prompt tokens, tokens computed, tokens reused from the local prefix
cache, and tokens pulled from the other pool over NIXL; and whether D continued from
the token P sampled (first-token handoff).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import urllib.request

_WORDS = ("kato rimu senlo vaqu zipe dramon elix orun shate bogal finu terwy the a is of "
          "and to in tool call result def return print").split()


def _post(url: str, body: dict, headers: dict[str, str]) -> tuple[dict, dict[str, str]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **headers})
    with urllib.request.urlopen(req, timeout=300) as resp:
        raw = resp.read()
        hdrs = {k.lower(): v for k, v in resp.headers.items()}
    if body.get("stream"):
        text = []
        for line in raw.decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices", []):
                    text.append((choice.get("delta") or {}).get("content") or "")
        return {"choices": [{"message": {"content": "".join(text)}}]}, hdrs
    return json.loads(raw), hdrs


def _yes_no(flag) -> str:
    # D's accounting omits false fields (a streamed answer carries none: "-").
    return "yes" if flag else "no"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--proxy", default="http://127.0.0.1:8000")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--stream", action="store_true")
    p.add_argument("--session", default="demo-session")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)

    with urllib.request.urlopen(args.proxy + "/v1/models", timeout=30) as resp:
        model = json.loads(resp.read())["data"][0]["id"]
    messages = [{"role": "system", "content": " ".join(rng.choices(_WORDS, k=120))}]
    print(f"{'turn':>4} {'route':<14} {'prompt':>6} {'computed':>8} {'local':>6} "
          f"{'pulled':>6} {'D pulled':>8} {'D from P token':>14}  (tokens)")
    for turn in range(1, args.turns + 1):
        messages.append({"role": "user", "content": " ".join(rng.choices(_WORDS, k=40))})
        body = {"model": model, "messages": messages, "max_tokens": args.max_tokens,
                "temperature": 0, "stream": args.stream, "prompt_cache_key": args.session}
        out, headers = _post(args.proxy + "/v1/chat/completions", body, {})
        prefill = json.loads(headers.get("x-sessionkv-prefill", "{}"))
        decode = json.loads(headers.get("x-sessionkv-decode", "{}"))
        route = headers.get("x-sessionkv-route", "?")
        first = prefill or decode
        print(f"{turn:>4} {route:<14} {first.get('prompt_tokens', 0):>6} "
              f"{first.get('recomputed_tokens', 0):>8} {first.get('local_hit_tokens', 0):>6} "
              f"{first.get('pulled_from_peer_tokens', 0):>6} "
              f"{decode.get('pulled_from_peer_tokens', '-') if prefill else '-':>8} "
              f"{_yes_no(decode.get('first_token_from_prefill')) if decode else '-':>14}")
        messages.append({"role": "assistant",
                         "content": out["choices"][0]["message"]["content"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
