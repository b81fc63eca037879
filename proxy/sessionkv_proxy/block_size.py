"""The KV block size, in tokens, that the router chains request keys in: the engines'.

Request keys only match the index when the router computes them in the engines' block
size, and engines differ by platform (vLLM's default is 16 on CUDA; the CPU build takes
multiples of 32).  So by default the proxy learns it from the first KV event that
carries one (``BlockStored.block_size``); a configured ``block_size`` is used as given.
An engine whose events carry another size is not indexed: its events are dropped,
counted (``sessionkv_proxy_events_dropped{reason="block_size_mismatch"}``) and named
in ``/health``, and a warning says which engine and which sizes.  Until the first
event the router uses ``UNLEARNED_TOKENS``, which only sizes load estimates: the
index is empty then, so no key can match whatever the size.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["BlockSize", "UNLEARNED_TOKENS"]

logger = logging.getLogger(__name__)

UNLEARNED_TOKENS = 32


class BlockSize:
    """Configured (``configured`` not None) or learned from the first event."""

    def __init__(self, configured: int | None) -> None:
        if configured is not None and configured <= 0:
            raise ValueError(f"block_size must be positive, got {configured}")
        self._configured = configured
        self._learned: int | None = None
        self._learned_from: str | None = None
        # engine -> the sizes its events carried that were refused
        self._refused: dict[str, set[int]] = {}

    @property
    def tokens(self) -> int:
        """The size request keys are chained in now."""
        if self._configured is not None:
            return self._configured
        return self._learned if self._learned is not None else UNLEARNED_TOKENS

    @property
    def known(self) -> bool:
        return self._configured is not None or self._learned is not None

    def accept(self, engine: str, block_size: int) -> bool:
        """Whether an event of ``engine`` with this block size can be indexed; the
        first one learns the size when none is configured."""
        if not self.known:
            self._learned, self._learned_from = block_size, engine
            logger.info("KV block size learned from the engines' events: %d tokens",
                        block_size, extra={"pod": engine})
            return True
        if block_size == self.tokens:
            return True
        refused = self._refused.setdefault(engine, set())
        if block_size not in refused:
            refused.add(block_size)
            source = ("block_size in the proxy config" if self._configured is not None
                      else f"learned from {self._learned_from}")
            logger.warning(
                "KV events of %s have block size %d, but the proxy routes in blocks of %d "
                "(%s): its events are dropped and routing ignores its cache. Start every "
                "engine with the same --block-size%s", engine, block_size, self.tokens,
                source, ", or set block_size to theirs" if self._configured else "",
                extra={"pod": engine})
        return False

    def report(self) -> dict[str, Any]:
        """For /health."""
        source = ("configured" if self._configured is not None
                  else f"learned from {self._learned_from}" if self._learned is not None
                  else "not yet learned (no KV event yet)")
        report: dict[str, Any] = {"tokens": self.tokens, "source": source}
        if self._refused:
            report["refused"] = {engine: sorted(sizes)
                                 for engine, sizes in self._refused.items()}
        return report

    def problems(self) -> list[str]:
        """One line per engine whose events are refused, for /health's problems."""
        return [f"kv events of {engine} have block size "
                f"{', '.join(map(str, sorted(sizes)))}, the proxy routes in blocks of "
                f"{self.tokens}: not indexed"
                for engine, sizes in self._refused.items()]
