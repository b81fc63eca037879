"""Agent sessions as OpenAI chat messages in text, and the re-tokenization loss.

Pure: the standard library only (and ``vllm_sessionkv.wire.hashing``, torch-free).

A chat session is what a coding agent's client sends each turn: a system prompt (and
the tools in the request), a task, then for every turn the model's previous answer
kept as text and a new user message (a tool result in text, or a follow-up).  The
answers are not known in advance: messages are built from an ``answers`` mapping
``(session id, turn) -> text``, in the reference run from its own answers, in every
arm from the reference's, so every arm sends the same messages and the engines render
the same prompts.

Some turns edit the previous answer before re-sending it, as agent clients do:
``trim`` keeps only its last line; ``drop_reasoning`` drops its first line (the
model's preamble before the code, standing in for the reasoning a client drops).  The
edit stays in the history for the later turns.  A sub-agent starts from its parent's
messages up to and including the answer of the turn it was spawned after.

The ceiling for text is the token-id one (``workload.workload_ceiling``) over the
prompts the engine rendered (``prompt_token_ids``).  Where a turn re-sends the previous
answer whole, the tokens lost at the re-tokenization boundary are the full blocks of
(the previous prompt + the ids generated for it) that the new prompt would share if the
answer came back as those ids, less the ones it shares as rendered
(``measure_turn``, the loss's one definition).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from agentload.workload import OutputKey, Session, Workload
from vllm_sessionkv.wire.hashing import common_prefix_len

__all__ = ["ChatConfig", "ChatTurn", "ChatWorkload", "Retokenization", "chat_workload",
           "edit_answer", "measure_turn", "retokenization_loss"]

EDITS = ("none", "trim", "drop_reasoning")

SYSTEM = ("You are a coding agent working in a Python repository. Rules: answer with short "
          "steps; show code in fenced blocks; call a tool by writing `tool: NAME(ARGS)` on a "
          "line of its own; never invent file contents; keep answers short. Tool results "
          "arrive as user messages that start with 'Tool result'.")
TOOLS = [{"type": "function", "function": {
    "name": name, "description": desc,
    "parameters": {"type": "object", "properties": {arg: {"type": "string"}},
                   "required": [arg]}}}
    for name, desc, arg in (
        ("read_file", "Read a file of the repository.", "path"),
        ("run_tests", "Run the unit tests matching a pattern.", "pattern"),
        ("grep", "Search the repository for a pattern.", "pattern"),
        ("write_file", "Write a file of the repository.", "path"))]
TASKS = [
    "Write a function that reverses a string, with a docstring.",
    "Add a function is_palindrome(s) to utils.py and a test for it.",
    "The test test_parse_config fails with KeyError: 'port'. Find the cause and fix it.",
    "Write a function that counts the words in a text file.",
    "Refactor the loop in stats.py that sums the squares of even numbers.",
    "Write a class Stack with push, pop and is_empty, and tests for it.",
    "Add type hints to the functions in io_utils.py.",
    "Make load_settings() in config.py fall back to defaults when the file is missing.",
]
_NAMES = ("value", "items", "path", "count", "result", "text", "config", "line", "total",
          "parts", "index", "name", "data", "key", "cache", "buffer")
_FUNCS = ("parse", "load", "save", "reverse", "count_words", "normalize", "split_lines",
          "merge", "validate", "render", "flatten", "lookup")


@dataclass(frozen=True)
class ChatTurn:
    user: str                 # the task (turn 0) or a tool result / follow-up, in text
    max_tokens: int
    stream: bool = False
    delay_s: float = 0.0      # tool delay before the turn is sent
    edit: str = "none"        # what the client does to the previous answer first

    @property
    def strip_reasoning(self) -> bool:
        """The token-id workload's name for "the client edited the previous output"
        (``measure.mismatches`` counts these turns apart)."""
        return self.edit != "none"


class ChatWorkload(Workload):
    """A workload whose sessions' steps are :class:`ChatTurn`; scheduling (start
    offsets, delays, dependencies, canonical order) is the token-id workload's."""

    system: str = SYSTEM
    tools: list = TOOLS

    def messages(self, sid: str, k: int, answers: dict[OutputKey, str]) -> list[dict]:
        """The messages turn ``k`` of ``sid`` sends; needs the answers of its earlier
        turns (and of its parent's turns up to the spawn)."""
        s = self.session(sid)
        if s.parent is not None:
            msgs = self.messages(s.parent, s.spawn_after, answers) + [
                {"role": "assistant", "content": answers[(s.parent, s.spawn_after)]}]
        else:
            msgs = [{"role": "system", "content": self.system}]
        for j in range(k + 1):
            turn = s.steps[j]
            if j > 0:
                msgs.append({"role": "assistant",
                             "content": edit_answer(answers[(sid, j - 1)], turn.edit)})
            msgs.append({"role": "user", "content": turn.user})
        return msgs

    def previous(self, sid: str, k: int) -> OutputKey | None:
        """The request whose answer this turn re-sends last (None for a first turn)."""
        s = self.session(sid)
        if k > 0:
            return (sid, k - 1)
        return (s.parent, s.spawn_after) if s.parent is not None else None

    def prompt(self, sid, k, outputs):  # noqa: D102 - the token-id form does not exist
        raise TypeError("a chat workload's prompts are rendered by the engine: messages()")

    def request(self, sid: str, k: int, answers: dict, model: str) -> tuple[str, dict]:
        """A ``/v1/chat/completions`` turn as agent clients send it: the messages, the
        tools (``tool_choice: none``: the model answers in text), temperature 0, the
        session in ``prompt_cache_key``, streamed or not as the turn says; and what the
        comparison needs: top-5 logprobs, the generated ids and the rendered prompt."""
        turn = self.session(sid).steps[k]
        body = {"model": model, "messages": self.messages(sid, k, answers),
                "tools": self.tools, "tool_choice": "none", "max_tokens": turn.max_tokens,
                "temperature": 0, "logprobs": True, "top_logprobs": 5,
                "return_token_ids": True, "prompt_cache_key": sid, "stream": turn.stream}
        if turn.stream:
            body["stream_options"] = {"include_usage": True}
        return "/v1/chat/completions", body

    def answer(self, sid: str, k: int, res):
        """The answer's text, kept in the history (None without ids or a rendered
        prompt: nothing to compare)."""
        return res.text if res.token_ids and res.prompt_token_ids else None


def edit_answer(text: str, edit: str) -> str:
    """The previous answer as the client re-sends it (``EDITS``)."""
    lines = [line for line in text.splitlines() if line.strip()]
    if edit == "trim" and lines:
        return lines[-1]
    if edit == "drop_reasoning" and len(lines) > 1:
        return text.split(lines[0], 1)[1].lstrip("\n")
    return text


@dataclass(frozen=True)
class ChatConfig:
    """The chat-text generator's knobs (sizes in words and tokens of the real model)."""

    sessions: int = 4
    turns: int = 5
    answer_tokens: int = 96        # max_tokens per answer (answers may end earlier)
    tool_result_lines: int = 24    # mean lines of a tool result (code or a test log)
    trim_share: float = 0.15       # turns after the first that trim the previous answer
    drop_share: float = 0.15       # ... that drop its first line
    stream_share: float = 0.75
    subagent_share: float = 0.25
    subagent_turns: int = 2
    tool_delay_s: float = 0.5      # mean; each drawn from 0.5x-1.5x
    # > 0: each tool delay lognormal instead, median tool_delay_s, sigma this (heavy tail)
    gap_sigma: float = 0.0
    stagger_s: float = 0.3
    seed: int = 0


def _tool_result(rng: random.Random, lines: int) -> str:
    """A tool result in text: a file's contents, a test log or grep hits."""
    kind = rng.choice(("read_file", "run_tests", "grep"))
    n = max(2, round(lines * rng.uniform(0.5, 1.5)))
    mod = rng.choice(("utils", "config", "stats", "io_utils", "parser", "cli"))
    if kind == "read_file":
        body = []
        for i in range(n):
            if i % 6 == 0:
                f, a = rng.choice(_FUNCS), rng.choice(_NAMES)
                body.append(f"def {f}_{i}({a}, {rng.choice(_NAMES)}=None):")
            else:
                a, b = rng.sample(_NAMES, 2)
                body.append(f"    {a} = {b}.{rng.choice(_FUNCS)}({rng.randrange(100)})"
                            if rng.random() < 0.7 else f"    return {a} + {b}")
        return f"Tool result (read_file {mod}.py):\n" + "\n".join(body)
    if kind == "run_tests":
        body = [f"tests/test_{mod}.py::test_{rng.choice(_FUNCS)}_{i} "
                f"{'FAILED' if rng.random() < 0.2 else 'PASSED'}" for i in range(n)]
        return (f"Tool result (run_tests test_{mod}):\n" + "\n".join(body)
                + f"\n{n} tests ran. Fix the failures.")
    body = [f"{mod}.py:{rng.randrange(1, 400)}: {rng.choice(_NAMES)} = "
            f"{rng.choice(_FUNCS)}({rng.choice(_NAMES)})  # TODO {rng.choice(_NAMES)}"
            for _ in range(n)]
    return "Tool result (grep TODO):\n" + "\n".join(body) + "\nHandle these TODOs."


def chat_workload(cfg: ChatConfig, name: str = "chat") -> ChatWorkload:
    rng = random.Random(cfg.seed)

    def jitter(x: float) -> float:
        return x * rng.lognormvariate(0.0, cfg.gap_sigma) if cfg.gap_sigma else \
            x * rng.uniform(0.5, 1.5)

    def make_turns(n: int, task: str) -> tuple[ChatTurn, ...]:
        out = []
        for k in range(n):
            edit = "none"
            if k > 0:
                r = rng.random()
                edit = ("trim" if r < cfg.trim_share else
                        "drop_reasoning" if r < cfg.trim_share + cfg.drop_share else "none")
            out.append(ChatTurn(user=task if k == 0 else _tool_result(rng, cfg.tool_result_lines),
                                max_tokens=cfg.answer_tokens,
                                stream=rng.random() < cfg.stream_share,
                                delay_s=0.0 if k == 0 else round(jitter(cfg.tool_delay_s), 3),
                                edit=edit))
        return tuple(out)

    sessions: list[Session] = []
    subagents: list[Session] = []
    for i in range(cfg.sessions):
        sid = f"{name}-s{i}"
        task = TASKS[(cfg.seed + i) % len(TASKS)]
        sessions.append(Session(sid=sid, head=(), steps=make_turns(cfg.turns, task),
                                start_s=round(i * cfg.stagger_s, 3)))
        if cfg.turns >= 2 and rng.random() < cfg.subagent_share:
            spawn = rng.randrange(0, cfg.turns - 1)
            sub_task = ("Sub-agent: review the change above and list what is still "
                        "missing, in at most five lines.")
            subagents.append(Session(sid=f"{sid}-sub", head=(), parent=sid,
                                     spawn_after=spawn,
                                     steps=make_turns(cfg.subagent_turns, sub_task)))
    all_sessions = sessions + subagents
    turns = [t for s in all_sessions for t in s.steps]
    desc = (f"chat text: {cfg.sessions} sessions x {cfg.turns} turns, {len(subagents)} "
            f"sub-agents x {cfg.subagent_turns} turns; answers up to {cfg.answer_tokens} "
            f"tokens; tool results ~{cfg.tool_result_lines} lines; "
            f"{sum(t.stream for t in turns)} of {len(turns)} turns streamed; "
            f"{sum(t.edit == 'trim' for t in turns)} trim and "
            f"{sum(t.edit == 'drop_reasoning' for t in turns)} drop the previous answer's "
            f"first line; tool delay ~{cfg.tool_delay_s:g} s" + (
                f" (lognormal median, sigma {cfg.gap_sigma:g}, p99 "
                f"{cfg.tool_delay_s * math.exp(2.326 * cfg.gap_sigma):.0f} s)" if cfg.gap_sigma
                else "") + f", seed {cfg.seed}")
    return ChatWorkload(name=name, sessions=all_sessions, think_open=None, description=desc)


# =========================================================================== re-tokenization
@dataclass
class Retokenization:
    turns: int            # turns that re-send the previous answer whole
    diverged: int         # ... whose rendered prompt leaves the generated ids in the answer
    ideal_tokens: int     # full-block tokens they would share with the held KV as ids
    kept_tokens: int      # ... that they share as rendered
    per_request: dict[OutputKey, tuple[int, int]]   # key -> (ideal, kept)
    examples: list[str]

    @property
    def lost_tokens(self) -> int:
        return self.ideal_tokens - self.kept_tokens


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


def retokenization_loss(workload: ChatWorkload, prompts: dict[OutputKey, list[int]],
                        outputs: dict[OutputKey, list[int]]) -> Retokenization:
    """Per turn that re-sends the previous answer unedited: what re-tokenizing it cost."""
    per: dict[OutputKey, tuple[int, int]] = {}
    diverged = 0
    examples: list[str] = []
    for sid, k in workload.keys():
        prev = workload.previous(sid, k)
        if prev is None or workload.session(sid).steps[k].edit != "none":
            continue
        ideal, kept, first_diff = measure_turn(prompts[prev], outputs[prev],
                                               prompts[(sid, k)], workload.block_size)
        per[(sid, k)] = (ideal, kept)
        if first_diff is not None and 0 <= first_diff < len(outputs[prev]):
            diverged += 1
            if len(examples) < 5:
                at = len(prompts[prev]) + first_diff
                examples.append(f"{sid}/{k}: generated ids "
                                f"{outputs[prev][first_diff:first_diff + 3]}, re-rendered "
                                f"{prompts[(sid, k)][at:at + 3]}")
    return Retokenization(len(per), diverged, sum(i for i, _ in per.values()),
                          sum(kp for _, kp in per.values()), per, examples)
