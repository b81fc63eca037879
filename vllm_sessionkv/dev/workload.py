"""A deterministic multi-session chat workload, shared by tests and benchmarks.

Sessions are distinct from their first token on (so they share no KV blocks), and
each turn adds a user message; callers decide how many new tokens D generates.
"""

from __future__ import annotations

__all__ = ["WORDS", "new_tokens", "system_prompt", "user_message"]

WORDS = ["kato", "rimu", "senlo", "vaqu", "zipe", "dramon", "elix", "shate", "bogal",
         "finu", "terwy", "orun", "qupe", "lova", "mura", "tosen"]


def system_prompt(session: int) -> str:
    words = [WORDS[(session * 5 + 3 * i) % len(WORDS)] for i in range(40)]
    return f"session {session} tool: " + " ".join(words) + "."


def user_message(session: int, turn: int) -> str:
    words = [WORDS[(session + 7 * turn + i) % len(WORDS)] for i in range(12)]
    return f"turn {turn}: " + " ".join(words) + "?"


def new_tokens(session: int, turn: int) -> int:
    """Tokens to generate this turn: 100..200, varying by session and turn."""
    return 100 + (37 * session + 53 * turn) % 101
