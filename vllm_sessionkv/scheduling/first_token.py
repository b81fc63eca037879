"""First-token handoff in the scheduler half (``vllm_sessionkv/first_token.py`` has
the rules): whether D continues from the token P sampled, each P token used once
(``n`` > 1 on D samples its own), and which token P exports."""

from __future__ import annotations

import logging

from vllm_sessionkv.first_token import FirstTokenRequest, handoff_refusal
from vllm_sessionkv.scheduling.counters import StatsSink

__all__ = ["FirstTokenHandoff"]

logger = logging.getLogger("vllm.sessionkv.scheduler")

# P requests whose token a D request continued from, remembered so that a second D
# request on the same handle (``n`` > 1) samples its own.
_USED_FIRST_TOKENS_KEPT = 4096


class FirstTokenHandoff:
    def __init__(self, turned_on: bool, unsupported: str | None,
                 used_kept: int = _USED_FIRST_TOKENS_KEPT) -> None:
        self.turned_on = turned_on
        # Why this engine cannot continue from P's token at all, or None.
        self.unsupported = unsupported if turned_on else "turned off (first_token_handoff)"
        if turned_on and unsupported:
            logger.info("sessionkv first-token handoff off on this engine: %s", unsupported)
        self._used: dict[str, None] = {}   # insertion-ordered, bounded
        self._used_kept = used_kept

    def continues(self, request_id: str, view: FirstTokenRequest | None, token_id: int,
                  verified_tokens: int, source: str, stats: StatsSink) -> bool:
        """Whether a D request continues from P's ``token_id`` (``view``: the request's
        sampling, None when it has none; ``source``: P's request id)."""
        refusal = "engine_unsupported" if self.unsupported else None
        if refusal is None:
            refusal = ("engine_unsupported" if view is None
                       else handoff_refusal(view, token_id, verified_tokens))
        if refusal is None and source and source in self._used:
            refusal = "already_used"
        stats.record(f"first_token_{refusal or 'continued'}")
        if refusal is not None:
            logger.debug("sessionkv first token request_id=%s not used: %s", request_id,
                         refusal)
            return False
        if source:
            self._used[source] = None
            if len(self._used) > self._used_kept:
                del self._used[next(iter(self._used))]
        return True

    def exported(self, output_token_ids: list[int], asked: bool) -> int | None:
        """The token P exports for D to continue from (P side), if asked for."""
        return output_token_ids[0] if self.turned_on and output_token_ids and asked else None
