"""Prefixes this proxy has just routed, before the engines' KV events confirm them.

The KV-event index learns that an engine holds a prefix only after the engine has
computed it and its events have arrived: a prefill later plus a publish interval.
Under concurrency, the requests of a prefix group that arrive in that window see no
overlap anywhere and are spread by load, so one group ends up computed on every
worker.  Routers that build their tree from their own decisions (SGLang's, vllm-router's
cache_aware) do not have that gap; Dynamo closes it with predicted blocks.  Here the
router records each decision's request keys for a short time and the policy credits
them like device blocks; after ``ttl_s`` only the index (the engines' own word)
counts, so a prefix an engine has since evicted stops attracting requests.

It also counts the placements each decode worker took in the same window: the
requests the policy sent there by cost, not by session or prefix affinity (new
sessions, new prefixes, requests a load bound released), so placement can spread new
prefixes and sessions by count as well as by in-flight work.  Requests that follow
their session or prefix are not counted: they go where they must, and counting them
let a worker's past traffic from finished conversations steer every new one away
from it for the rest of the window.

In-process only: another replica learns the same prefix from the index a moment
later.  A wrong guess costs speed, never correctness (the engines verify).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

__all__ = ["RecentRoutes"]


class RecentRoutes:
    def __init__(self, ttl_s: float = 30.0, max_keys: int = 200_000) -> None:
        if ttl_s < 0 or max_keys <= 0:
            raise ValueError("RecentRoutes needs ttl_s >= 0 and max_keys > 0")
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self._keys: OrderedDict[int, dict[str, float]] = OrderedDict()
        self._placed: dict[str, deque[float]] = {}  # engine -> times it took a placement

    def __len__(self) -> int:
        return len(self._keys)

    def record(self, keys: Sequence[int], engines: Iterable[str], now_s: float) -> None:
        """``engines`` were sent a request whose prompt has these leading keys."""
        if self.ttl_s == 0:
            return
        engines = tuple(engines)
        table = self._keys
        for key in keys:
            seen = table.get(key)
            if seen is None:
                seen = table[key] = {}
            else:
                table.move_to_end(key)
            for engine in engines:
                seen[engine] = now_s
        while len(table) > self.max_keys:
            table.popitem(last=False)

    def clear(self) -> None:
        """Forget every route: the engines' caches were reset, so none holds them."""
        self._keys.clear()
        self._placed.clear()

    def record_placement(self, engine: str, now_s: float) -> None:
        """``engine`` was chosen by cost for a request no affinity tied to a worker."""
        if self.ttl_s:
            self._placed.setdefault(engine, deque()).append(now_s)

    def placement_counts(self, now_s: float) -> dict[str, int]:
        """Engine -> placements it took within ``ttl_s``."""
        oldest = now_s - self.ttl_s
        out = {}
        for engine, times in self._placed.items():
            while times and times[0] < oldest:
                times.popleft()
            out[engine] = len(times)
        return out

    def overlaps(self, keys: Sequence[int], now_s: float) -> dict[str, int]:
        """Engine -> leading keys of ``keys`` it was sent within ``ttl_s``."""
        out: dict[str, int] = {}
        alive: set[str] | None = None
        oldest = now_s - self.ttl_s
        for depth, key in enumerate(keys, start=1):
            seen = self._keys.get(key)
            if not seen:
                break
            here = {engine for engine, t in seen.items() if t >= oldest}
            alive = here if alive is None else alive & here
            if not alive:
                break
            for engine in alive:
                out[engine] = depth
        return out
