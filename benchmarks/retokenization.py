"""Re-tokenization loss: reuse lost where a re-sent answer tokenizes differently from
the ids D generated; the loss's one definition (``agentload.chat`` counts it per turn
of ``agent_workload.py --client chat``).

A chat client sends each answer back as text.  The engine renders the template again
and tokenizes that text; where its ids differ from those D generated, D's KV for the
answer no longer matches the prompt, and verification refuses every block from the
first differing one on (the KV of a token depends on every token before it).

The transformers run that wrote docs/benchmarks/retokenization.md (before and after
the proxy's ``resend_answer_ids``, no engine) was removed as a one-off; it is in git
history: ``git show 4742b72:benchmarks/retokenization.py``.
"""

from __future__ import annotations

from vllm_sessionkv.wire.hashing import common_prefix_len

__all__ = ["measure_turn"]


def measure_turn(prev_prompt: list[int], answer: list[int], prompt: list[int],
                 block_size: int) -> tuple[int, int, int | None]:
    """(ideal, kept, first differing answer token or None) for one turn boundary.

    What D holds after the previous turn is ``prev_prompt + answer``, KV computed for
    all but the last sampled token, in full blocks.  ``ideal``: those blocks' tokens,
    all of which ``prompt`` would share if the answer came back as D's own ids;
    ``kept``: those it shares as rendered; the first differing token is counted from
    the answer's start (negative: inside the previous prompt)."""
    held = prev_prompt + answer
    computed = len(held) - 1            # the last sampled token's KV is never computed
    ideal = computed // block_size * block_size
    common = common_prefix_len(held, prompt)
    kept = min(common, computed) // block_size * block_size
    first_diff = common - len(prev_prompt) if common < len(held) else None
    return ideal, kept, first_diff
