"""Agent workloads in token ids, how each step's prompt is built, and the reuse ceiling.

Pure: the standard library only, no I/O but the replay files' text.

A workload is a list of :class:`Session` scripts.  A session's prompt at step ``k``
is its history: the shared prefix (or, for a sub-agent, its parent's history up to
the spawn), then for every step the step's new tokens (the task, then a tool
output), a ``<think>`` opener, and the tokens the model generated at that step.
The generated tokens are not known in advance, so prompts are built from an
``outputs`` mapping ``(session id, step) -> token ids``: during the reference run
from the reference's own answers, in every arm from the reference's answers too,
so every arm sends exactly the same prompts and the ceiling holds for all of them.

On a *strip* step the client drops the previous step's reasoning from the history it
re-sends, as agent clients do: the ``<think>`` opener and the first
``think_tokens`` generated tokens go, the rest of that output (the tool call) stays.
The history then differs from what D computed from the position of the opener on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["AgentConfig", "Ceiling", "Session", "Step", "Workload", "agent_workload",
           "block_chain", "ceiling", "mooncake_workload", "workload_ceiling"]

OutputKey = tuple[str, int]


@dataclass(frozen=True)
class Step:
    new_tokens: tuple[int, ...]   # the task (step 0) or a tool output, appended first
    max_tokens: int               # tokens generated at this step (ignore_eos)
    delay_s: float = 0.0          # tool delay before the step is sent
    strip_reasoning: bool = False  # drop the previous step's <think> and reasoning
    think_tokens: int = 0         # leading generated tokens that are reasoning


@dataclass(frozen=True)
class Session:
    sid: str
    head: tuple[int, ...]         # history before step 0 (top-level sessions)
    steps: tuple[Step, ...]
    parent: str | None = None     # sub-agent: inherits the parent's history ...
    spawn_after: int = -1         # ... up to and including this step's output
    start_s: float = 0.0          # offset from the run's start (stagger, replays)
    hot: bool = False             # skewed workloads: one of the hot sessions


@dataclass
class Workload:
    name: str
    sessions: list[Session]
    block_size: int = 32
    think_open: int | None = None  # token id of <think>; None: no reasoning markers
    description: str = ""
    _by_id: dict[str, Session] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._by_id = {s.sid: s for s in self.sessions}
        if len(self._by_id) != len(self.sessions):
            raise ValueError("duplicate session ids")
        for s in self.sessions:
            if s.parent is not None:
                parent = self._by_id.get(s.parent)
                if parent is None or not 0 <= s.spawn_after < len(parent.steps):
                    raise ValueError(f"{s.sid}: bad parent {s.parent}/{s.spawn_after}")

    def session(self, sid: str) -> Session:
        return self._by_id[sid]

    @property
    def n_steps(self) -> int:
        return sum(len(s.steps) for s in self.sessions)

    def keys(self) -> list[OutputKey]:
        return [(s.sid, k) for s in self.sessions for k in range(len(s.steps))]

    def prompt(self, sid: str, k: int, outputs: dict[OutputKey, list[int]]) -> list[int]:
        """The token ids step ``k`` of ``sid`` sends; needs the outputs of its earlier
        steps (and of its parent's steps up to the spawn)."""
        s = self._by_id[sid]
        if s.parent is not None:
            hist = self.prompt(s.parent, s.spawn_after, outputs) + list(
                outputs[(s.parent, s.spawn_after)])
        else:
            hist = list(s.head)
        for j in range(k + 1):
            step = s.steps[j]
            if j > 0:
                prev_out = list(outputs[(sid, j - 1)])
                if step.strip_reasoning and self.think_open is not None:
                    # History ends with the <think> opener of step j-1's prompt.
                    hist = hist[:-1] + prev_out[s.steps[j - 1].think_tokens:]
                else:
                    hist = hist + prev_out
            hist += step.new_tokens
            if self.think_open is not None:
                hist.append(self.think_open)
        return hist

    def dependencies(self, sid: str, k: int) -> list[OutputKey]:
        """The outputs step ``k`` of ``sid`` must wait for."""
        s = self._by_id[sid]
        deps = [(sid, k - 1)] if k > 0 else []
        if k == 0 and s.parent is not None:
            deps.append((s.parent, s.spawn_after))
        return deps

    def canonical_order(self) -> list[OutputKey]:
        """Every step after the steps it depends on, otherwise by estimated send time
        (start offset plus tool delays); the ceiling is the same for any order that
        respects the dependencies, because sessions share blocks only through the
        prefix and through a sub-agent's inherited history."""
        est: dict[OutputKey, float] = {}

        def when(sid: str, k: int) -> float:
            if (sid, k) in est:
                return est[(sid, k)]
            s = self._by_id[sid]
            if k == 0:
                base = s.start_s
                if s.parent is not None:
                    base = max(base, when(s.parent, s.spawn_after) + 1e-3)
            else:
                base = when(sid, k - 1) + 1e-3
            est[(sid, k)] = base + s.steps[k].delay_s
            return est[(sid, k)]

        return sorted(self.keys(), key=lambda key: (when(*key), key))

    def request(self, sid: str, k: int, answers: dict, model: str) -> tuple[str, dict]:
        """The path and body step ``k`` of ``sid`` sends (``answers``: the earlier steps'
        generated ids): a streamed ``/v1/completions`` of token ids, temperature 0,
        ``ignore_eos``, top-5 logprobs and the generated ids."""
        return "/v1/completions", {
            "model": model, "prompt": self.prompt(sid, k, answers),
            "max_tokens": self.session(sid).steps[k].max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "logprobs": 5, "return_token_ids": True}

    def answer(self, sid: str, k: int, res):
        """What a step's answer (a ``client.StepResult``) puts into the history: its
        generated ids, when all of them came; else None."""
        return res.token_ids if len(res.token_ids) == self.session(sid).steps[k].max_tokens \
            else None


# =========================================================================== ceiling
def block_chain(tokens: list[int], block_size: int) -> list[bytes]:
    """A chained digest per full block: equal digests mean equal tokens from position 0
    to the end of that block (what a prefix cache can reuse)."""
    out, parent = [], b""
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size:(i + 1) * block_size]
        parent = hashlib.sha256(parent + json.dumps(block).encode()).digest()
        out.append(parent)
    return out


@dataclass
class Ceiling:
    prompt_tokens: int
    reusable_tokens: int
    per_request: dict[OutputKey, tuple[int, int]]   # key -> (prompt, reusable)

    @property
    def max_reuse_factor(self) -> float:
        computed = self.prompt_tokens - self.reusable_tokens
        return self.prompt_tokens / computed if computed else math.inf

    @property
    def reusable_share(self) -> float:
        return self.reusable_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def ceiling(requests: Iterable[tuple[OutputKey, list[int], list[int]]],
            block_size: int) -> Ceiling:
    """The theoretical maximum reuse of ``(key, prompt, output)`` requests in order.

    A prompt's leading full blocks whose tokens an earlier request already computed
    (its prompt, or its output but the last token, whose KV is never computed) are
    reusable; as in vLLM, at least the prompt's last token is always computed."""
    seen: set[bytes] = set()
    per: dict[OutputKey, tuple[int, int]] = {}
    total = reusable = 0
    for key, prompt, output in requests:
        hit = 0
        for digest in block_chain(prompt, block_size):
            if digest not in seen:
                break
            hit += 1
        can = min(hit, (len(prompt) - 1) // block_size) * block_size if prompt else 0
        per[key] = (len(prompt), can)
        total += len(prompt)
        reusable += can
        seen.update(block_chain(list(prompt) + list(output[:-1]), block_size))
    return Ceiling(total, reusable, per)


def workload_ceiling(workload: Workload, outputs: dict[OutputKey, list[int]],
                     prompts: dict[OutputKey, list[int]] | None = None) -> Ceiling:
    """The ceiling of a workload's requests in canonical order: ``prompts`` as sent (a
    chat workload's, as the engine rendered them), else the token-id prompts built from
    ``outputs``."""
    return ceiling(((key, prompts[key] if prompts else workload.prompt(*key, outputs),
                     outputs[key]) for key in workload.canonical_order()), workload.block_size)


# =========================================================================== generator
@dataclass(frozen=True)
class AgentConfig:
    """The coding-agent generator's knobs (tokens are model token ids)."""

    sessions: int = 6
    steps: int = 5                 # steps per session (mean, when skewed)
    prefix_tokens: int = 768       # system prompt + tool schemas + repository snapshot
    task_tokens: int = 48
    tool_output_tokens: int = 192  # mean; each one drawn from 0.5x-1.5x
    output_tokens: int = 24        # generated per step (a tool call)
    think_tokens: int = 8          # of those, the leading reasoning a strip removes
    tool_delay_s: float = 0.5      # mean; each one drawn from 0.5x-1.5x
    strip_share: float = 0.3       # share of steps (after the first) that strip
    subagent_share: float = 0.25   # share of sessions that spawn one sub-agent
    subagent_steps: int = 2
    skew: float = 0.0              # 0: equal steps; s > 0: steps ~ 1 / rank^s
    stagger_s: float = 0.3         # session i starts at i * stagger_s
    seed: int = 0
    vocab_lo: int = 16             # token ids drawn from [vocab_lo, vocab_hi)
    vocab_hi: int = 1000
    think_open: int = 5            # <think> in the generated models' vocabulary


def steps_per_session(cfg: AgentConfig) -> list[int]:
    """``sessions * steps`` steps split over the sessions; with ``skew`` s the i-th
    session's share is proportional to 1 / (i + 1)^s (a few hot sessions)."""
    total = cfg.sessions * cfg.steps
    if cfg.skew <= 0:
        return [cfg.steps] * cfg.sessions
    weights = [1.0 / (i + 1) ** cfg.skew for i in range(cfg.sessions)]
    raw = [total * w / sum(weights) for w in weights]
    counts = [max(1, int(r)) for r in raw]
    # Hand the remainder to the largest fractional parts, hot sessions first.
    order = sorted(range(cfg.sessions), key=lambda i: (-(raw[i] - int(raw[i])), i))
    i = 0
    while sum(counts) < total:
        counts[order[i % len(order)]] += 1
        i += 1
    while sum(counts) > total:
        j = max(range(cfg.sessions), key=lambda x: counts[x])
        counts[j] -= 1
    return counts


def agent_workload(cfg: AgentConfig, name: str = "agent") -> Workload:
    rng = random.Random(cfg.seed)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(cfg.vocab_lo, cfg.vocab_hi) for _ in range(max(1, n)))

    def jitter(x: float) -> float:
        return x * rng.uniform(0.5, 1.5)

    def make_steps(n: int, task: tuple[int, ...]) -> tuple[Step, ...]:
        out = []
        for k in range(n):
            new = task if k == 0 else tokens(round(jitter(cfg.tool_output_tokens)))
            out.append(Step(new_tokens=new, max_tokens=cfg.output_tokens,
                            delay_s=0.0 if k == 0 else round(jitter(cfg.tool_delay_s), 3),
                            strip_reasoning=k > 0 and rng.random() < cfg.strip_share,
                            think_tokens=min(cfg.think_tokens, cfg.output_tokens - 1)))
        return tuple(out)

    prefix = tokens(cfg.prefix_tokens)
    counts = steps_per_session(cfg)
    sessions: list[Session] = []
    subagents: list[Session] = []
    for i, n in enumerate(counts):
        sid = f"{name}-s{i}"
        task = tokens(cfg.task_tokens)
        steps = make_steps(n, task)
        sessions.append(Session(sid=sid, head=prefix, steps=steps,
                                start_s=round(i * cfg.stagger_s, 3), hot=cfg.skew > 0 and i < 2))
        if n >= 2 and rng.random() < cfg.subagent_share:
            spawn = rng.randrange(0, n - 1)
            subagents.append(Session(sid=f"{sid}-sub", head=(), parent=sid, spawn_after=spawn,
                                     steps=make_steps(cfg.subagent_steps,
                                                      tokens(cfg.task_tokens))))
    desc = (f"coding agent: {cfg.sessions} sessions x {cfg.steps} steps"
            + (f" (skew {cfg.skew:g}: steps per session {counts})" if cfg.skew > 0 else "")
            + f", {len(subagents)} sub-agents x {cfg.subagent_steps} steps, shared prefix "
            f"{cfg.prefix_tokens}, task {cfg.task_tokens}, tool output ~{cfg.tool_output_tokens}"
            f", output {cfg.output_tokens} ({cfg.think_tokens} reasoning), tool delay "
            f"~{cfg.tool_delay_s:g} s, strip share {cfg.strip_share:g}, seed {cfg.seed}")
    return Workload(name=name, sessions=sessions + subagents, think_open=cfg.think_open,
                    description=desc)


# =========================================================================== replays
def mooncake_workload(lines: Iterable[str], block_size: int = 32, trace_block_tokens: int = 512,
                      time_scale: float = 1.0, max_requests: int | None = None,
                      max_output_tokens: int = 16, vocab_lo: int = 16, vocab_hi: int = 1000,
                      max_prompt_tokens: int | None = None, name: str = "mooncake") -> Workload:
    """Mooncake trace JSONL (``timestamp`` ms, ``input_length``, ``output_length``,
    ``hash_ids``).  One hash id is one block of identical content: here one block of
    ``block_size`` tokens drawn from a generator seeded by the id, so blocks the trace
    shares are shared token for token.  Lengths shrink by ``block_size /
    trace_block_tokens`` (the trace's blocks are 512 tokens); send times are the
    trace's timestamps times ``time_scale``, from the first request of the slice.
    Requests longer than ``max_prompt_tokens`` after scaling are left out (counted in
    the description)."""
    scale = block_size / trace_block_tokens
    sessions = []
    t0 = None
    too_long = 0
    for line in lines:
        if not line.strip():
            continue
        rec = json.loads(line)
        ids = list(rec["hash_ids"])
        if not ids:
            continue
        if max_requests and len(sessions) + too_long >= max_requests:
            break
        if max_prompt_tokens and len(ids) * block_size > max_prompt_tokens:
            too_long += 1
            continue
        t0 = rec["timestamp"] if t0 is None else t0
        prompt: list[int] = []
        for h in ids:
            r = random.Random(f"mooncake-{h}")
            prompt += [r.randrange(vocab_lo, vocab_hi) for _ in range(block_size)]
        # The last hash id covers the remainder of the input; keep its scaled share.
        rem = rec["input_length"] - trace_block_tokens * (len(ids) - 1)
        last = max(1, min(block_size, round(rem * scale)))
        prompt = prompt[:block_size * (len(ids) - 1) + last]
        out = max(1, min(max_output_tokens, round(rec["output_length"] * scale)))
        sessions.append(Session(sid=f"{name}-{len(sessions)}", head=tuple(prompt),
                                steps=(Step(new_tokens=(), max_tokens=out),),
                                start_s=round((rec["timestamp"] - t0) / 1000 * time_scale, 3)))
    return Workload(name=name, sessions=sessions, block_size=block_size, think_open=None,
                    description=f"Mooncake trace replay: {len(sessions)} requests"
                                + (f" ({too_long} longer than {max_prompt_tokens} tokens left "
                                   "out)" if too_long else "")
                                + f", one hash id = {block_size} tokens, time x{time_scale:g}")


def mooncake_file_ceiling(lines: Iterable[str], max_requests: int | None = None) -> float:
    """The share of a trace slice's blocks whose hash id (with all before it) an
    earlier request had: the ceiling computed from the file alone."""
    seen: set[int] = set()
    blocks = hits = n = 0
    for line in lines:
        if not line.strip():
            continue
        ids = json.loads(line)["hash_ids"]
        if not ids:
            continue
        lead = 0
        for h in ids:
            if h not in seen:
                break
            lead += 1
        blocks += len(ids)
        hits += lead
        seen.update(ids)
        n += 1
        if max_requests and n >= max_requests:
            break
    return hits / blocks if blocks else 0.0


def without_waits(workload: Workload) -> Workload:
    """The same workload with no start offsets and no tool delays (the reference run
    needs only the answers, not the timing)."""
    sessions = [dataclasses.replace(s, start_s=0.0, steps=tuple(
        dataclasses.replace(st, delay_s=0.0) for st in s.steps)) for s in workload.sessions]
    return type(workload)(name=workload.name, sessions=sessions,
                          block_size=workload.block_size, think_open=workload.think_open,
                          description=workload.description)


def pin_sessions(workload, urls: list[str]) -> dict[str, str]:
    """Each session's engine for the reference run: top-level sessions round robin over
    ``urls`` in order, a sub-agent on its parent's (it starts from the parent's
    history, so its prefix is cached there)."""
    pinned: dict[str, str] = {}
    for i, s in enumerate(s for s in workload.sessions if s.parent is None):
        pinned[s.sid] = urls[i % len(urls)]
    for s in workload.sessions:
        if s.parent is not None:
            pinned[s.sid] = pinned[s.parent]
    return pinned
