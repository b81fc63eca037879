"""Running a scenario: the repository's paths, a log line, ports from the benchmarks'
range, and arms measured in interleaved rounds.
Standard library only: the side venv's python imports the benchmarks to draw their
figures."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH_DIR = REPO / "benchmarks"
PORT_LO, PORT_HI = 30000, 31999
UCX_PORT_RANGE = "31900-31999"   # kept out of the pool: UCX listeners of the P/D engines


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def interrupt_on_sigterm() -> None:
    """SIGTERM raises KeyboardInterrupt, so a run stops as on Ctrl-C and writes its report."""
    def interrupt(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, interrupt)


class PortPool:
    """Free ports from 30000-31999 (the UCX range excluded), never handed out twice."""

    def __init__(self, lo: int = PORT_LO, hi: int = int(UCX_PORT_RANGE.split("-")[0]) - 1):
        self._next, self._hi = lo, hi

    @staticmethod
    def _free(port: int) -> bool:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                return False
        return True

    def take(self, n: int = 1) -> int:
        """The first of ``n`` consecutive free ports."""
        while self._next + n - 1 <= self._hi:
            start = self._next
            self._next += 1
            if all(self._free(p) for p in range(start, start + n)):
                self._next = start + n
                return start
        raise RuntimeError(f"no {n} consecutive free ports left in {PORT_LO}-{self._hi}")


def env_for_bench() -> None:
    # UCX's TCP listeners of the P/D engines stay in the bench's port range.
    os.environ.setdefault("UCX_TCP_PORT_RANGE", UCX_PORT_RANGE)


def round_order(names: Iterable[str], round_index: int) -> list[str]:
    """The order arms run in round ``round_index`` (0-based): as given in even rounds,
    reversed in odd ones, so no arm always runs first or right after another."""
    names = list(names)
    return names if round_index % 2 == 0 else names[::-1]


def interleaved(names: Iterable[str], rounds: int, measure: Callable[[str, int], object]
                ) -> dict[str, list]:
    """``measure(name, round_index)`` for every name once a round (``round_order``);
    each name's results in round order."""
    names = list(names)
    out: dict[str, list] = {n: [] for n in names}
    for r in range(rounds):
        for name in round_order(names, r):
            log(f"round {r + 1}/{rounds}: {name}")
            out[name].append(measure(name, r))
    return out
