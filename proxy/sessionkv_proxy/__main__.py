"""``sessionkv-proxy``: run the router.

    sessionkv-proxy --port 8000 \\
        --prefill url=http://127.0.0.1:8100,events=tcp://127.0.0.1:5600,replay=tcp://127.0.0.1:5601 \\
        --decode  url=http://127.0.0.1:8200,events=tcp://127.0.0.1:5610,replay=tcp://127.0.0.1:5611 \\
        [--redis-url redis://127.0.0.1:6379/0 | redis+cluster://HOST:PORT]
        [--config proxy.json]

Flags override the JSON config file.  The config is validated before the port is
bound; a bad key exits with status 2 and its name.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from sessionkv_proxy.config import ConfigError, Role, load_config, parse_engine_spec

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sessionkv-proxy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="JSON config file (see sessionkv_proxy.config.ProxyConfig)")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--prefill", action="append", default=[], metavar="SPEC",
                   help="prefill engine: URL or url=URL,events=EP,replay=EP (repeatable)")
    p.add_argument("--decode", action="append", default=[], metavar="SPEC",
                   help="decode engine: URL or url=URL,events=EP,replay=EP[,early=EP] "
                        "(repeatable; early: the engine's early-decode socket)")
    p.add_argument("--redis-url", help="share the index and sessions through Redis: "
                        "redis://HOST:PORT/DB, or redis+cluster://HOST:PORT (any node) "
                        "for a Redis Cluster")
    p.add_argument("--policy", choices=["cost", "round_robin"])
    p.add_argument("--block-size", type=int, help="engines' --block-size (default 32)")
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
    p.add_argument("--log-level")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        engines = ([parse_engine_spec(s, Role.PREFILL) for s in args.prefill]
                   + [parse_engine_spec(s, Role.DECODE) for s in args.decode])
        overrides = {"engines": engines, "host": args.host, "port": args.port,
                     "block_size": args.block_size, "tokenizer": args.tokenizer,
                     "log_level": args.log_level,
                     "first_token_handoff": args.first_token_handoff}
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
