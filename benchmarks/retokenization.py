"""Re-tokenization loss: reuse lost where a re-sent answer tokenizes differently from
the ids D generated.

A chat client sends each answer back as text.  The engine renders the template again
and tokenizes that text; where its ids differ from those D generated, D's KV for the
answer no longer matches the prompt, and verification refuses every block from the
first differing one on (the KV of a token depends on every token before it, so no
block after a difference is reusable, whatever its own tokens).

For each turn k > 1 of chat sessions on a real instruct model (greedy answers kept
whole in the history, so the client itself trims nothing) this compares

* what D holds after turn k-1: the ids of prompt k-1 and of its answer, KV computed
  for all but the last sampled token, in full blocks as the engines hash them;
* prompt k as the template renders it with the answer as text.

``ideal`` is the full blocks D holds that prompt k would share if the answer came
back as the very ids D generated; ``kept`` those it shares as rendered; ``lost`` the
difference, in tokens.

Each session runs twice: as a chat client's turns reach the engine (``before``), and
as the proxy sends them with ``resend_answer_ids`` on (``after``): the proxy's own
``resent_answers.splice`` (with its tokenizer and chat renderer) decides each turn's
prompt ids, so the answer re-sent unchanged comes back as the ids generated for it,
and the model answers that prompt (the sessions can part from there).  The loss is stated against the ideal and against the answer
tokens.  Generation runs in transformers (greedy, float32; the question is the
tokenizer and the template, which are vLLM's own: ``apply_chat_template`` renders as
vLLM 0.32 does for a Hugging Face tokenizer), no engine needed.

    sessionkv-real-model /tmp/smollm2
    python benchmarks/retokenization.py --model /tmp/smollm2 [--sessions 3 --turns 3]

Prints a table and writes docs/benchmarks/retokenization.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from sessionkv_bench.report import machine_line  # noqa: E402
from sessionkv_bench.runner import REPO, log  # noqa: E402
from sessionkv_bench import report  # noqa: E402

from vllm_sessionkv.wire.hashing import common_prefix_len  # noqa: E402

from sessionkv_proxy.chat_template import ChatRenderer  # noqa: E402
from sessionkv_proxy.resent_answers import LastAnswer, splice  # noqa: E402
from sessionkv_proxy.tokenizer import LocalTokenizer  # noqa: E402

SYSTEM = ("You are a coding agent working in a Python repository. Rules: answer with "
          "short steps; show code in fenced blocks; call tools by writing "
          "`tool: NAME(ARGS)` on a line of its own; never invent file contents; keep "
          "answers under ten lines. Tools: read_file(path), run_tests(pattern), "
          "grep(pattern), write_file(path, text).")
TASKS = [
    "Write a function that reverses a string, with a docstring.",
    "Add a function is_palindrome(s) to utils.py and a test for it.",
    "Explain what a Python list comprehension is, with an example.",
    "The test test_parse_config fails with KeyError: 'port'. What do you check first?",
    "Write a function that counts the words in a text file.",
    "Refactor a loop that sums squares of even numbers into one expression.",
    "How do I read a JSON file and print one of its keys?",
    "Write a class Stack with push, pop and is_empty.",
]
FOLLOW_UPS = [
    "Tool result (run_tests): 3 passed, 1 failed: test_empty_input - AssertionError. "
    "Fix it.",
    "Tool result (read_file utils.py): def helper(x):\n    return x * 2\n"
    "Now use helper in your answer.",
    "Make it handle None input and explain the change in one line.",
    "Tool result (grep 'TODO'): utils.py:12: # TODO handle unicode. Handle it.",
    "Add type hints and a short example call.",
]


@dataclass
class TurnLoss:
    session: int
    turn: int
    answer_tokens: int        # ids D generated for the previous turn
    ended_on_eos: bool
    ideal_tokens: int         # full-block tokens of D's KV the next prompt would share
    kept_tokens: int          # ... that it shares as rendered
    lost_tokens: int
    diverged: bool            # the re-rendered prompt left D's ids inside the answer
    first_diff_in_answer: int | None   # answer token where it left them
    context: str = ""         # the generated ids and the re-tokenized ones there
    resent: bool = False      # after: the previous answer went back as its generated ids
    spliced: bool = False     # ... and they differ from the template's


def measure_turn(prev_prompt: list[int], answer: list[int], prompt: list[int],
                 block_size: int) -> tuple[int, int, int | None]:
    """(ideal, kept, first differing answer token or None) for one turn boundary."""
    held = prev_prompt + answer
    computed = len(held) - 1            # the last sampled token's KV is never computed
    ideal = computed // block_size * block_size
    common = common_prefix_len(held, prompt)
    kept = min(common, computed) // block_size * block_size
    first_diff = common - len(prev_prompt) if common < len(held) else None
    return ideal, kept, first_diff


class Generator:
    """Greedy answers in transformers, each prompt generated once (the two regimes
    share every prompt up to the first spliced one)."""

    def __init__(self, model_dir: str, max_new_tokens: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(0)
        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.eval()
        self.eos = self.tokenizer.eos_token_id
        self.max_new_tokens = max_new_tokens
        self._done: dict[tuple[int, ...], list[int]] = {}

    def answer(self, prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in self._done:
            with self.torch.no_grad():
                out = self.model.generate(
                    self.torch.tensor([prompt]), max_new_tokens=self.max_new_tokens,
                    do_sample=False, eos_token_id=self.eos,
                    pad_token_id=self.tokenizer.pad_token_id or self.eos)
            self._done[key] = out[0][len(prompt):].tolist()
        return self._done[key]


def run(gen: Generator, model_dir: str, sessions: int, turns: int, block_size: int,
        resend: bool) -> list[TurnLoss]:
    """One regime's sessions: ``resend`` sends each prompt as the proxy does with
    ``resend_answer_ids`` on."""
    tokenizer, eos = gen.tokenizer, gen.eos
    local = LocalTokenizer.load(str(Path(model_dir) / "tokenizer.json"))
    renderer = ChatRenderer(local)
    results: list[TurnLoss] = []
    for s in range(sessions):
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": TASKS[s % len(TASKS)]}]
        prev_prompt: list[int] | None = None
        last: LastAnswer | None = None
        answer: list[int] = []
        for t in range(1, turns + 1):
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                   tokenize=True)
            if hasattr(prompt, "input_ids"):
                prompt = prompt["input_ids"]
            prompt = list(prompt)
            text, _ = renderer.render({"messages": messages})
            resent = spliced = False
            if resend and last is not None:
                ids = splice(text, prompt, last, local.encode)
                if ids is not None:
                    resent, spliced, prompt = True, ids != prompt, ids
            if prev_prompt is not None:
                results.append(_measure(tokenizer, eos, s, t, prev_prompt, answer, prompt,
                                        block_size, resent, spliced))
            if t == turns:
                break
            answer = gen.answer(prompt)
            # What a chat client gets back (vLLM skips special tokens) and re-sends.
            reply = tokenizer.decode(answer, skip_special_tokens=True)
            own = answer[:-1] if answer and answer[-1] == eos else answer
            last = (LastAnswer(text, tuple(prompt), reply, tuple(own))
                    if local.decode(own) == reply else None)
            messages += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": FOLLOW_UPS[(s + t) % len(FOLLOW_UPS)]}]
            prev_prompt = prompt
    return results


def _measure(tokenizer, eos: int, s: int, t: int, prev_prompt: list[int],
             answer: list[int], prompt: list[int], block_size: int,
             resent: bool, spliced: bool) -> TurnLoss:
    ideal, kept, first_diff = measure_turn(prev_prompt, answer, prompt, block_size)
    context = ""
    if first_diff is not None:
        at = len(prev_prompt) + first_diff
        context = (f"generated {tokenizer.convert_ids_to_tokens(answer[first_diff:first_diff + 3])}"
                   f" re-tokenized {tokenizer.convert_ids_to_tokens(prompt[at:at + 3])}")
    log(f"session {s} turn {t}: answer {len(answer)} tokens, kept {kept}/{ideal}"
        + (" (spliced)" if spliced else "")
        + (f", diverged at answer token {first_diff}: {context}"
           if first_diff is not None else ""))
    return TurnLoss(session=s, turn=t, answer_tokens=len(answer),
                    ended_on_eos=bool(answer) and answer[-1] == eos, ideal_tokens=ideal,
                    kept_tokens=kept, lost_tokens=ideal - kept,
                    diverged=first_diff is not None and 0 <= first_diff < len(answer),
                    first_diff_in_answer=first_diff, context=context, resent=resent,
                    spliced=spliced)


def summarize(results: list[TurnLoss]) -> dict:
    ideal = sum(r.ideal_tokens for r in results)
    lost = sum(r.lost_tokens for r in results)
    answers = sum(r.answer_tokens for r in results)
    return {"turns": len(results), "turns_diverged": sum(r.diverged for r in results),
            "ideal_tokens": ideal, "kept_tokens": ideal - lost, "lost_tokens": lost,
            "lost_share_of_ideal": lost / ideal if ideal else 0.0,
            "answer_tokens": answers,
            "lost_share_of_answer_tokens": lost / answers if answers else 0.0}


def _table(results: list[TurnLoss]) -> str:
    rows = ["| session | turn | answer tokens | EOS | ideal | kept | lost | first differing answer token | spliced |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        rows.append(f"| {r.session} | {r.turn} | {r.answer_tokens} | "
                    f"{'yes' if r.ended_on_eos else 'no'} | {r.ideal_tokens} | "
                    f"{r.kept_tokens} | {r.lost_tokens} | "
                    f"{'-' if not r.diverged else r.first_diff_in_answer} | "
                    f"{'yes' if r.spliced else '-'} |")
    return "\n".join(rows)


def _loss_line(summary: dict) -> str:
    return (f"**{summary['lost_tokens']}** of {summary['ideal_tokens']} "
            f"({summary['lost_share_of_ideal']:.1%} of the ideal, "
            f"{summary['lost_share_of_answer_tokens']:.1%} of the "
            f"{summary['answer_tokens']} answer tokens)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF folder (sessionkv-real-model DIR)")
    p.add_argument("--sessions", type=int, default=3)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--out", default=str(REPO / "docs" / "benchmarks" / "retokenization"),
                   help="report path without suffix (.md and .json are written)")
    args = p.parse_args(argv)
    started = time.time()
    machine = machine_line()
    gen = Generator(args.model, args.max_new_tokens)
    regimes = {name: run(gen, args.model, args.sessions, args.turns, args.block_size,
                         resend=name == "after") for name in ("before", "after")}
    summaries = {name: summarize(results) for name, results in regimes.items()}
    for name, results in regimes.items():
        print(f"{name}:")
        print(_table(results))
        print(json.dumps(summaries[name], indent=1))
    command = (f"python benchmarks/retokenization.py --model MODEL --sessions {args.sessions} "
               f"--turns {args.turns} --max-new-tokens {args.max_new_tokens} "
               f"--block-size {args.block_size}")
    out = Path(args.out)
    meta = {"date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
            "commit": report.commit(), "machine": machine, "command": command,
            "model": json.loads((Path(args.model) / "sessionkv_real_model.json").read_text())
            if (Path(args.model) / "sessionkv_real_model.json").is_file() else args.model,
            "duration_s": round(time.time() - started, 1)}
    out.with_suffix(".json").write_text(json.dumps(
        {"meta": meta, "summary": summaries,
         "turns": {name: [asdict(r) for r in results] for name, results in regimes.items()}},
        indent=1) + "\n")
    before, after = summaries["before"], summaries["after"]
    diverged = [r for r in regimes["before"] if r.diverged]
    examples = "\n".join(f"* session {r.session} turn {r.turn}: {r.context}"
                         for r in diverged[:6]) or "* none"
    out.with_suffix(".md").write_text(f"""# Re-tokenization loss, before and after `resend_answer_ids`

{meta['date_utc']}, commit {meta['commit']}, {meta['duration_s']:.0f} s.
Machine: {machine}.
Model: SmolLM2-135M-Instruct (`sessionkv-real-model`), float32, greedy, in transformers.
Command: `{command}`

{before['turns']} turn boundaries a regime, answers kept whole in the history. D's KV
after a turn is the previous prompt and its answer (all but the last sampled token),
counted in full blocks of {args.block_size} tokens as the engines hash them. *Before*:
the answer re-sent as text, tokenized by the template. *After*: each prompt as the proxy
sends it with `resend_answer_ids` on (its `resent_answers.splice`, tokenizer and chat
renderer), the model answering that prompt.

| | before | after |
|---|---|---|
| ideal (the answer re-sent as D's own ids) | {before['ideal_tokens']} | {after['ideal_tokens']} |
| kept | {before['kept_tokens']} | {after['kept_tokens']} |
| lost at re-tokenization | {_loss_line(before)} | {_loss_line(after)} |
| turns whose prompt left D's ids inside the answer | {before['turns_diverged']} of {before['turns']} | {after['turns_diverged']} of {after['turns']} |
| turns whose previous answer went back as its generated ids | - | {sum(r.resent for r in regimes['after'])} of {after['turns']} |
| ... where those differ from the template's | - | {sum(r.spliced for r in regimes['after'])} |

Where the re-rendered prompt left D's ids (before):

{examples}

Per turn, before:

{_table(regimes['before'])}

Per turn, after:

{_table(regimes['after'])}
""")
    log(f"wrote {out.with_suffix('.md')} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
