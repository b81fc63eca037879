"""The agent benchmark's chat-text workload: messages, client edits, sub-agents, the
text ceiling and the re-tokenization loss (pure; no engines)."""

from __future__ import annotations



from agentload.chat import (
    ChatConfig,
    ChatTurn,
    ChatWorkload,
    chat_workload,
    edit_answer,
    retokenization_loss,
)
from agentload.workload import Session, workload_ceiling

ANSWER = "Here is the fix.\n```python\ndef f(x):\n    return x\n```\nDone."


def _two_turns(edit: str) -> ChatWorkload:
    return ChatWorkload(name="t", sessions=[Session(sid="s", head=(), steps=(
        ChatTurn(user="task", max_tokens=8), ChatTurn(user="tool", max_tokens=8, edit=edit)))])


def test_edits_keep_the_last_line_or_drop_the_first():
    assert edit_answer(ANSWER, "none") == ANSWER
    assert edit_answer(ANSWER, "trim") == "Done."
    assert edit_answer(ANSWER, "drop_reasoning") == ANSWER.split("\n", 1)[1]
    assert edit_answer("one line", "drop_reasoning") == "one line"   # nothing else to keep


def test_messages_keep_answers_as_text_and_apply_the_edit():
    w = _two_turns("trim")
    msgs = w.messages("s", 1, {("s", 0): ANSWER})
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[2]["content"] == "Done." and msgs[3]["content"] == "tool"
    assert w.previous("s", 1) == ("s", 0) and w.previous("s", 0) is None


def test_a_subagent_starts_from_its_parents_history_and_answer():
    w = chat_workload(ChatConfig(sessions=2, turns=3, subagent_share=1.0, subagent_turns=1,
                                 seed=3))
    sub = next(s for s in w.sessions if s.parent is not None)
    answers = {k: f"answer {k}" for k in w.keys()}
    parent = w.messages(sub.parent, sub.spawn_after, answers)
    msgs = w.messages(sub.sid, 0, answers)
    assert msgs[:len(parent)] == parent
    assert msgs[len(parent)] == {"role": "assistant",
                                 "content": answers[(sub.parent, sub.spawn_after)]}
    assert w.previous(sub.sid, 0) == (sub.parent, sub.spawn_after)


def test_generator_is_seeded_and_says_what_it_made():
    cfg = ChatConfig(sessions=3, turns=4, seed=7)
    a, b = chat_workload(cfg), chat_workload(cfg)
    assert a.description == b.description
    assert [s.steps for s in a.sessions] == [s.steps for s in b.sessions]
    assert all(t.user.startswith("Tool result") for s in a.sessions for t in s.steps[1:])


def test_text_ceiling_and_retokenization_loss():
    w = _two_turns("none")
    p0 = list(range(100, 170))                     # 70 tokens: two full blocks
    out0 = list(range(200, 240))                   # 40 generated ids
    same = p0 + out0 + [7, 8, 9]                   # the answer re-rendered as its own ids
    ceil = workload_ceiling(w, {("s", 0): out0, ("s", 1): [1]}, {("s", 0): p0, ("s", 1): same})
    # (p0 + out0[:-1]) = 109 tokens: three full blocks are reusable by turn 1.
    assert ceil.per_request[("s", 1)] == (len(same), 96)
    retok = retokenization_loss(w, {("s", 0): p0, ("s", 1): same}, {("s", 0): out0})
    assert (retok.turns, retok.diverged, retok.ideal_tokens, retok.lost_tokens) == (1, 0, 96, 0)
    # The re-rendered answer differs from the generated ids at its 5th token: blocks
    # from the one holding it on are lost (block 2 starts at 64; 70 + 4 = 74 is in it).
    moved = p0 + out0[:4] + [999] + out0[5:] + [7, 8, 9]
    retok = retokenization_loss(w, {("s", 0): p0, ("s", 1): moved}, {("s", 0): out0})
    assert (retok.diverged, retok.ideal_tokens, retok.kept_tokens) == (1, 96, 64)
    ceil = workload_ceiling(w, {("s", 0): out0, ("s", 1): [1]}, {("s", 0): p0, ("s", 1): moved})
    assert ceil.per_request[("s", 1)][1] == 64
    # An edited previous answer is the client's doing, not re-tokenization's.
    assert retokenization_loss(_two_turns("trim"), {("s", 0): p0, ("s", 1): moved},
                               {("s", 0): out0}).turns == 0


def test_rounds_pool_their_samples_for_the_forced_pd_comparison():
    """``--rounds``: each arm's TTFT and e2e samples from every round are pooled into
    one p50/p99 (nearest rank) per arm, and the report's forced P/D comparison uses them;
    one round alone pools nothing (its figures are the run's own)."""
    from agentload import report

    def arm(ttft, e2e):
        return {"ttft_samples_s": ttft, "e2e_samples_s": e2e}

    results = {"runs": {"chat": {"7-ours-pd": arm([1.0, 2.0], [5.0, 6.0]),
                                 "5-vr-cache": arm([2.0, 4.0], [6.0, 8.0])}},
               "rounds": {"2": {"chat": {"7-ours-pd": arm([3.0, 9.0], [7.0, 9.0]),
                                         "5-vr-cache": arm([1.0, 3.0], [5.0, 7.0])}}}}
    ours = report.pooled(results, "chat", "7-ours-pd")
    assert ours["rounds"] == 2 and ours["ttft_n"] == 4
    assert (ours["ttft_p50_s"], ours["ttft_p99_s"]) == (2.0, 9.0)
    assert (ours["e2e_p50_s"], ours["e2e_p99_s"]) == (6.0, 9.0)
    (line,) = [x for x in report.headlines(results) if "pooled" in x]
    assert "pooled over 2 rounds" in line and "TTFT p50 2.000 vs 2.000 s = 1.00" in line
    assert "p99 9.000 vs 4.000 s = 0.44" in line
    # The control: a single run is not pooled.
    del results["rounds"]
    assert report.pooled(results, "chat", "7-ours-pd") is None
    assert not [x for x in report.headlines(results) if "pooled" in x]
