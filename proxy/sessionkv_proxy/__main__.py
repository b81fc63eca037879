"""``sessionkv-proxy``: run the router."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from sessionkv_proxy.config import (LOG_LEVELS, ConfigError, Role, load_config,
                                    parse_engine_spec)

__all__ = ["main"]

_DESCRIPTION = """\
An OpenAI-compatible router for vLLM prefill (P) and decode (D) pools: routes each
request by session, by where its prompt's KV is cached (the engines' KV events) and
by load, and relays the answer.

  sessionkv-proxy --port 8000 \\
    --prefill url=http://10.0.0.1:8100,events=tcp://10.0.0.1:5557,replay=tcp://10.0.0.1:5558 \\
    --decode  url=http://10.0.0.2:8100,events=tcp://10.0.0.2:5557,replay=tcp://10.0.0.2:5558,early=tcp://10.0.0.2:5700 \\
    [--redis-url redis://10.0.0.9:6379/0] [--config proxy.json]

Flags override the JSON config file; every key of that file, with its default, is in
docs/running.md.  The config is checked before the port is bound: a bad key or value
exits with status 2 naming it.
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sessionkv-proxy", description=_DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", metavar="FILE",
                   help="JSON config file: any key of the proxy config (docs/running.md, "
                        "'The proxy'); flags override it")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1; 0.0.0.0 for every address)")
    p.add_argument("--port", type=int, help="port to listen on (default 8000)")
    p.add_argument("--prefill", action="append", default=[], metavar="SPEC",
                   help="prefill engine: URL or url=URL,events=EP,replay=EP[,topic=T] "
                        "(repeatable; events/replay: its KV-event PUB and replay sockets)")
    p.add_argument("--decode", action="append", default=[], metavar="SPEC",
                   help="decode engine: URL or url=URL,events=EP,replay=EP[,topic=T]"
                        "[,early=EP][,handles=EP] (repeatable; early: the engine's "
                        "early-decode socket, its connector's early_decode_port; handles: "
                        "its handle channel, its connector's handle_channel_port)")
    p.add_argument("--engines-file", metavar="FILE",
                   help="a JSON array of engines (each as in the config's 'engines'), "
                        "read in place of --prefill/--decode and watched: engines are "
                        "added and removed as its content changes, without a restart")
    p.add_argument("--redis-url", help="share the index and sessions through Redis: "
                        "redis://HOST:PORT/DB, or redis+cluster://HOST:PORT (any node) "
                        "for a Redis Cluster (default: in-process, this replica only)")
    p.add_argument("--policy", choices=["cost", "round_robin"],
                   help="routing policy (default cost: cache, session and load; "
                        "round_robin: ignores them, a baseline)")
    p.add_argument("--block-size", type=int,
                   help="the engines' --block-size (default: learned from their KV events)")
    p.add_argument("--tokenizer", metavar="engine|none|text|PATH",
                   help="token ids for routing: 'engine' asks an engine's /tokenize "
                        "(default), 'none' routes without them, 'text' routes on blocks "
                        "of the prompt's text (engines without KV events), PATH (the "
                        "model directory given to vllm serve, or its tokenizer.json) "
                        "tokenizes prompts in the proxy once they match the engine's")
    p.add_argument("--decode-only-max-uncached-tokens", type=int,
                   help="serve on D directly when at most this many prompt tokens are "
                        "uncached there (-1: never)")
    p.add_argument("--no-first-token-handoff", dest="first_token_handoff",
                   action="store_false", default=None,
                   help="ask P engines not to hand D the token they sampled (D then "
                        "recomputes the last prompt token, as stock P/D does)")
    p.add_argument("--resend-answer-ids", action="store_true", default=None,
                   help="re-send a chat session's previous answer as the token ids D "
                        "generated (needs --tokenizer DIR; see docs/running.md)")
    p.add_argument("--log-level", metavar="LEVEL",
                   help=f"one of {', '.join(LOG_LEVELS)} (default INFO)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        engines = ([parse_engine_spec(s, Role.PREFILL) for s in args.prefill]
                   + [parse_engine_spec(s, Role.DECODE) for s in args.decode])
        overrides = {"engines": engines, "engines_file": args.engines_file,
                     "host": args.host, "port": args.port,
                     "block_size": args.block_size, "tokenizer": args.tokenizer,
                     "log_level": args.log_level,
                     "first_token_handoff": args.first_token_handoff,
                     "resend_answer_ids": args.resend_answer_ids}
        if args.redis_url:
            overrides["index"] = {"backend": "redis", "redis_url": args.redis_url}
        routing: dict = {}
        if args.policy:
            routing["policy"] = args.policy
        if args.decode_only_max_uncached_tokens is not None:
            routing["params"] = {"decode_only_max_uncached_tokens":
                                 args.decode_only_max_uncached_tokens}
        if routing:
            overrides["routing"] = routing
        config = load_config(args.config, overrides)
    except ConfigError as exc:
        print(f"sessionkv-proxy: {exc}", file=sys.stderr)
        return 2
    from sessionkv_proxy._aiohttp import AiohttpInternalsChanged, check_installed

    try:
        check_installed()
    except AiohttpInternalsChanged as exc:
        print(f"sessionkv-proxy: {exc}", file=sys.stderr)
        return 1
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    from sessionkv_proxy.app import serve

    # SIGINT/SIGTERM: stop accepting, finish in-flight requests up to 30 s, close.
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(config))
    else:
        uvloop.run(serve(config))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
