"""Re-tokenization loss: reuse lost where a re-sent answer tokenizes differently from
the ids D generated (issue 38, item 4).

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
difference, in tokens.  The loss is stated against the ideal and against the answer
tokens.  Generation runs in transformers (greedy, float32; the question is the
tokenizer and the template, which are vLLM's own: ``apply_chat_template`` renders as
vLLM 0.32 does for a Hugging Face tokenizer), no engine needed.

    sessionkv-real-model /tmp/smollm2
    python benchmarks/retokenization.py --model /tmp/smollm2 [--sessions 6 --turns 6]

Prints a table and writes docs/benchmarks/retokenization.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import REPO, log, machine_line  # noqa: E402

from vllm_sessionkv.wire.hashing import common_prefix_len  # noqa: E402

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


def run(model_dir: str, sessions: int, turns: int, max_new_tokens: int,
        block_size: int) -> list[TurnLoss]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model.eval()
    eos = tokenizer.eos_token_id
    results: list[TurnLoss] = []
    for s in range(sessions):
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": TASKS[s % len(TASKS)]}]
        prev_prompt: list[int] | None = None
        answer: list[int] = []
        for t in range(1, turns + 1):
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                   tokenize=True)
            if hasattr(prompt, "input_ids"):
                prompt = prompt["input_ids"]
            prompt = list(prompt)
            if prev_prompt is not None:
                ideal, kept, first_diff = measure_turn(prev_prompt, answer, prompt,
                                                       block_size)
                context = ""
                if first_diff is not None:
                    at = len(prev_prompt) + first_diff
                    context = (f"generated {tokenizer.convert_ids_to_tokens(answer[first_diff:first_diff + 3])}"
                               f" re-tokenized {tokenizer.convert_ids_to_tokens(prompt[at:at + 3])}")
                results.append(TurnLoss(
                    session=s, turn=t, answer_tokens=len(answer),
                    ended_on_eos=bool(answer) and answer[-1] == eos,
                    ideal_tokens=ideal, kept_tokens=kept, lost_tokens=ideal - kept,
                    diverged=first_diff is not None and 0 <= first_diff < len(answer),
                    first_diff_in_answer=first_diff, context=context))
                log(f"session {s} turn {t}: answer {len(answer)} tokens, kept {kept}/"
                    f"{ideal}" + (f", diverged at answer token {first_diff}: {context}"
                                  if first_diff is not None else ""))
            if t == turns:
                break
            with torch.no_grad():
                out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                                     do_sample=False, eos_token_id=eos,
                                     pad_token_id=tokenizer.pad_token_id or eos)
            answer = out[0][len(prompt):].tolist()
            # What a chat client gets back (vLLM skips special tokens) and re-sends.
            text = tokenizer.decode(answer, skip_special_tokens=True)
            messages += [{"role": "assistant", "content": text},
                         {"role": "user", "content": FOLLOW_UPS[(s + t) % len(FOLLOW_UPS)]}]
            prev_prompt = prompt
    return results


def summarize(results: list[TurnLoss]) -> dict:
    ideal = sum(r.ideal_tokens for r in results)
    lost = sum(r.lost_tokens for r in results)
    answers = sum(r.answer_tokens for r in results)
    return {"turns": len(results), "turns_diverged": sum(r.diverged for r in results),
            "ideal_tokens": ideal, "kept_tokens": ideal - lost, "lost_tokens": lost,
            "lost_share_of_ideal": lost / ideal if ideal else 0.0,
            "answer_tokens": answers,
            "lost_share_of_answer_tokens": lost / answers if answers else 0.0}


def _git_commit() -> str:
    return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip() or "?"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF folder (sessionkv-real-model DIR)")
    p.add_argument("--sessions", type=int, default=6)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--out", default=str(REPO / "docs" / "benchmarks" / "retokenization"),
                   help="report path without suffix (.md and .json are written)")
    args = p.parse_args(argv)
    started = time.time()
    machine = machine_line()
    results = run(args.model, args.sessions, args.turns, args.max_new_tokens,
                  args.block_size)
    summary = summarize(results)
    rows = ["| session | turn | answer tokens | EOS | ideal | kept | lost | first differing answer token |",
            "|---|---|---|---|---|---|---|---|"]
    for r in results:
        rows.append(f"| {r.session} | {r.turn} | {r.answer_tokens} | "
                    f"{'yes' if r.ended_on_eos else 'no'} | {r.ideal_tokens} | "
                    f"{r.kept_tokens} | {r.lost_tokens} | "
                    f"{'-' if not r.diverged else r.first_diff_in_answer} |")
    table = "\n".join(rows)
    print(table)
    print(json.dumps(summary, indent=1))
    command = (f"python benchmarks/retokenization.py --model MODEL --sessions {args.sessions} "
               f"--turns {args.turns} --max-new-tokens {args.max_new_tokens} "
               f"--block-size {args.block_size}")
    out = Path(args.out)
    meta = {"date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
            "commit": _git_commit(), "machine": machine, "command": command,
            "model": json.loads((Path(args.model) / "sessionkv_real_model.json").read_text())
            if (Path(args.model) / "sessionkv_real_model.json").is_file() else args.model,
            "duration_s": round(time.time() - started, 1)}
    out.with_suffix(".json").write_text(json.dumps(
        {"meta": meta, "summary": summary, "turns": [asdict(r) for r in results]}, indent=1)
        + "\n")
    diverged = [r for r in results if r.diverged]
    examples = "\n".join(f"* session {r.session} turn {r.turn}: {r.context}"
                         for r in diverged[:6]) or "* none"
    out.with_suffix(".md").write_text(f"""# Re-tokenization loss

{meta['date_utc']}, commit {meta['commit']}, {meta['duration_s']:.0f} s.
Machine: {machine}.
Model: SmolLM2-135M-Instruct (`sessionkv-real-model`), float32, greedy, in transformers.
Command: `{command}`

{summary['turns']} turn boundaries, answers kept whole in the history. D's KV after a
turn is the previous prompt and its answer (all but the last sampled token), counted
in full blocks of {args.block_size} tokens as the engines hash them.

| | tokens |
|---|---|
| ideal (the answer re-sent as D's own ids) | {summary['ideal_tokens']} |
| kept (the answer re-sent as text, re-tokenized) | {summary['kept_tokens']} |
| **lost at re-tokenization** | **{summary['lost_tokens']}** ({summary['lost_share_of_ideal']:.1%} of the ideal, {summary['lost_share_of_answer_tokens']:.1%} of the {summary['answer_tokens']} answer tokens) |

Turns whose re-rendered prompt left D's ids inside the answer: {summary['turns_diverged']}
of {summary['turns']}. Where:

{examples}

Per turn:

{table}
""")
    log(f"wrote {out.with_suffix('.md')} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
