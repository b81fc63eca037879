"""Token ids of a prompt text that extends an earlier one, tokenizing only its new part.

A chat session's next turn renders to its last turn's text plus the answer and the
new message, and the proxy tokenizes every turn's prompt to route it: the whole
history again each turn, the largest CPU cost of a chat request in the proxy
(a 750-token prompt took 1.5 ms here).  :class:`ExtendingIds` keeps each session's
last text and ids and tokenizes only from the last *cut* the two texts share.

A cut is the end of an added token ``T`` in the earlier text's ids (matched whole,
``normalized``, ``lstrip``, ``rstrip`` and ``single_word`` all false, and not
starting or ending in whitespace), with the texts equal for at least the longest
added token past it (plus one character).  The new ids are then the earlier ids
before ``T`` plus the ids of ``T`` + the new text after the cut, exactly as if the
whole text had been tokenized (``tokenizers`` 0.2x, with ``add_special_tokens``
false):

* added tokens are found first, leftmost-longest over the whole text; every choice
  up to the cut reads at most the longest added token (and one character) past
  where it starts, text the two share, so ``T`` ends the same match in both, and
  the search after ``T`` starts at the cut in either text;
* the text between added tokens is normalized, pre-tokenized and split into words
  piece by piece: a piece after ``T`` is the same piece in both (the one rule that
  looks at a piece's place, Metaspace's ``prepend_scheme`` "first", asks whether it
  starts the text, and it does in neither);
* without special tokens the post-processor adds no ids.

Texts asking for special tokens (``add_special_tokens``), tokenizers that split
special tokens (``split_special_tokens``) or that have no added token to cut at are
tokenized whole.  The first extensions of a process, and then one in
``CHECK_EVERY``, are also tokenized whole and compared: a difference logs an error,
is answered with the whole text's ids, and turns extending off for the process.
"""

from __future__ import annotations

import array
import bisect
import logging
from collections import OrderedDict
from typing import Any

__all__ = ["CHECK_EVERY", "CHECK_FIRST", "MAX_TOKENS", "ExtendingIds"]

logger = logging.getLogger("sessionkv_proxy.text_ids")

# The ids kept, all sessions together (4 bytes each, with their texts at about
# 4 characters a token: about 36 MB); the least recently used session goes first.
MAX_TOKENS = 4_000_000
# Extensions checked against tokenizing the whole text: the first ones, then one in so many.
CHECK_FIRST = 16
CHECK_EVERY = 512


class _Tokenized:
    """A text, its ids, and where later texts may be cut: ``cut_ends[i]`` is the
    character after a cut token, ``cut_index[i]`` that token's place in ``ids``."""

    __slots__ = ("text", "ids", "cut_ends", "cut_index")

    def __init__(self, text: str, ids: array.array, cut_ends: list[int],
                 cut_index: list[int]) -> None:
        self.text = text
        self.ids = ids
        self.cut_ends = cut_ends
        self.cut_index = cut_index


def _common_prefix(a: str, b: str) -> int:
    """How many leading characters ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if b.startswith(a[:n] if n < len(a) else a):
        return n
    lo, hi = 0, n   # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if b.startswith(a[lo:mid], lo):
            lo = mid
        else:
            hi = mid
    return lo


class ExtendingIds:
    """Each key's (a session's) last text and ids; :meth:`ids` of its next text."""

    def __init__(self, tokenizer: Any, max_tokens: int = MAX_TOKENS,
                 check_first: int = CHECK_FIRST, check_every: int = CHECK_EVERY) -> None:
        """``tokenizer``: a ``tokenizers.Tokenizer`` set up as the engine's (the
        local tokenizer's)."""
        self._tok = tokenizer
        added = tokenizer.get_added_tokens_decoder()
        # Text that decides an added-token match past a cut: its longest one, plus
        # the character a single_word token checks after it.
        self._window = max((len(t.content) for t in added.values()), default=0) + 1
        self._cut_tokens: dict[int, str] = {} if tokenizer.encode_special_tokens else {
            tid: t.content for tid, t in added.items()
            if t.content and not t.content[0].isspace() and not t.content[-1].isspace()
            and not (t.normalized or t.lstrip or t.rstrip or t.single_word)}
        self._max_tokens = max_tokens
        self._check_first = check_first
        self._check_every = check_every
        self._texts: OrderedDict[str, _Tokenized] = OrderedDict()
        self._tokens = 0
        self.extended = 0   # texts tokenized from a cut (a measure for tests)

    @property
    def enabled(self) -> bool:
        return bool(self._cut_tokens)

    def ids(self, key: str | None, text: str, add_special_tokens: bool) -> list[int]:
        """``text``'s ids, as ``encode(text, add_special_tokens)`` gives them; from
        ``key``'s last text where ``text`` extends it."""
        if key is None or add_special_tokens or not self._cut_tokens:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        previous = self._texts.pop(key, None)
        if previous is not None:
            self._tokens -= len(previous.ids)
        if previous is not None and previous.text == text:
            now, ids = previous, previous.ids.tolist()
        else:
            now, ids = self._tokenize(previous, text)
        if self._cut_tokens and len(now.ids) <= self._max_tokens:   # (off after a mismatch)
            self._texts[key] = now
            self._tokens += len(now.ids)
            while self._tokens > self._max_tokens:
                _, dropped = self._texts.popitem(last=False)
                self._tokens -= len(dropped.ids)
        return ids

    def _tokenize(self, previous: _Tokenized | None, text: str
                  ) -> tuple[_Tokenized, list[int]]:
        if previous is not None and previous.cut_ends:
            shared = _common_prefix(previous.text, text)
            at = bisect.bisect_right(previous.cut_ends, shared - self._window) - 1
            if at >= 0:
                extended = self._extend(previous, at, text)
                if extended is not None:
                    return extended
        enc = self._tok.encode(text, add_special_tokens=False)
        ids = enc.ids
        ends, index = self._cuts(text, enc, ids, 0, 0, 0)
        return _Tokenized(text, array.array("I", ids), ends, index), ids

    def _extend(self, previous: _Tokenized, at: int, text: str
                ) -> tuple[_Tokenized, list[int]] | None:
        """``text`` tokenized from ``previous``'s cut ``at``; None if that cut's token
        does not start the new part's ids (which the module doc rules out)."""
        cut, k = previous.cut_ends[at], previous.cut_index[at]
        token = self._cut_tokens[previous.ids[k]]
        start = cut - len(token)
        part = token + text[cut:]
        enc = self._tok.encode(part, add_special_tokens=False)
        new = enc.ids
        if not new or new[0] != previous.ids[k] or enc.token_to_chars(0) != (0, len(token)):
            return None
        ids = previous.ids[:k].tolist() + new
        self.extended += 1
        if self.extended <= self._check_first or self.extended % self._check_every == 0:
            whole = self._tok.encode(text, add_special_tokens=False).ids
            if whole != ids:
                differs = next((i for i, (a, b) in enumerate(zip(whole, ids)) if a != b),
                               min(len(whole), len(ids)))
                logger.error("token ids of a text tokenized from a cut differ from the "
                             "whole text's (id %d of %d); texts are tokenized whole from "
                             "now on", differs, len(whole))
                self._cut_tokens = {}
                self._texts.clear()
                self._tokens = 0
                return _Tokenized(text, array.array("I", whole), [], []), whole
        ends, index = self._cuts(part, enc, new, 1, start, k)
        tokenized = _Tokenized(
            text, previous.ids[:k] + array.array("I", new),
            previous.cut_ends[:at + 1] + ends, previous.cut_index[:at + 1] + index)
        return tokenized, ids

    def _cuts(self, text: str, enc: Any, ids: list[int], first: int, offset: int,
              base: int) -> tuple[list[int], list[int]]:
        """The cuts among ``ids`` (from ``first`` on) of ``text``, an encoding of
        the whole text's characters from ``offset`` and its ids from ``base``."""
        tokens = self._cut_tokens
        ends, index = [], []
        for i in range(first, len(ids)):
            content = tokens.get(ids[i])
            if content is not None:
                s, e = enc.token_to_chars(i)
                if e - s == len(content) and text.startswith(content, s):
                    ends.append(offset + e)
                    index.append(base + i)
        return ends, index
