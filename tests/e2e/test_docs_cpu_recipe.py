"""docs/running.md's by-hand CPU recipe works when pasted (issue 49 must-show 2).

The fenced blocks marked ``<!-- cpu-recipe -->`` are run, in order, as one bash script
in a process group of their own, with the recipe's settings given in the environment:
free ports, the two cores, the tiny test model and a log folder of the test's.  The
session's co-located vLLM server (the same model, float32, the same block size) is the
reference.  Then:

* the recipe's own chat turn printed the route the doc says a short turn gets
  (``decode_only``, with the defaults);
* a two-turn chat session through the recipe's proxy, each turn over 256 tokens new
  to D, is served P -> D (``disaggregated``), and on turn 2 P takes turn 1's prompt
  from its own cache and pulls turn 1's answer from D, as the doc says;
* every answer equals the co-located server's, token ids and top-5 logprobs, at
  temperature 0 (the recipe's float32); the negative control: turn 2's answer
  differs from the co-located answer to another prompt.

About a minute and a half, most of it the recipe's two engine starts on two cores.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from cluster import free_port_block
from helpers import assert_same, chat_body, compare, post


pytestmark = pytest.mark.cluster

DOC = Path(__file__).resolve().parents[2] / "docs" / "running.md"
MARKER = "<!-- cpu-recipe -->"
NAME = "tiny-recipe"
WORDS = ("kato rimu senlo vaqu zipe dramon elix orun shate bogal finu terwy the a is of "
         "and to in tool call result def return print").split()


def recipe_blocks(text: str) -> list[str]:
    """The bash blocks that follow a marker line, in order."""
    return re.findall(re.escape(MARKER) + r"\n```bash\n(.*?)```", text, re.S)


def test_the_recipe_blocks_are_found():
    text = DOC.read_text()
    blocks = recipe_blocks(text)
    assert len(blocks) == text.splitlines().count(MARKER) >= 4
    script = "\n".join(blocks)
    for needed in ("--block-size 32", "--kv-cache-memory-bytes", "--dtype float32",
                   "redis-server", "VLLM_CPU_OMP_THREADS_BIND", "sessionkv-proxy"):
        assert needed in script, needed


def _words(n: int, seed: int) -> str:
    return " ".join(WORDS[(i * 7 + seed) % len(WORDS)] for i in range(n))


def _log_summary(path: Path) -> str:
    """A log's first error lines (why an engine stopped) and its last lines."""
    lines = path.read_text(errors="replace").splitlines()
    errors = list(dict.fromkeys(line for line in lines if re.search(r"\w+Error: ", line)))
    return "\n".join([f"--- {path.name}", *errors[:3], "...", *lines[-8:]])


@pytest.fixture
def recipe(tiny_model, colocated_url, tmp_path):
    """Runs the recipe; yields (the recipe's proxy, the session's co-located server on
    the same model in float32, the script's output); stops what it started."""
    cores = sorted(os.sched_getaffinity(0))
    base, port = free_port_block(11), free_port_block(1)
    env = {**os.environ, "MODEL": tiny_model, "NAME": NAME, "PORT": str(port),
           "BASE": str(base), "P_CORE": str(cores[0]), "D_CORE": str(cores[-1]),
           "LOGS": str(tmp_path / "logs")}
    script = "set -u\n" + "\n".join(recipe_blocks(DOC.read_text()))
    output = tmp_path / "recipe.out"
    with open(output, "w") as out_file:
        proc = subprocess.Popen(["bash", "-c", script], env=env, cwd=tmp_path,
                                stdout=out_file, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        # Until the script ends, or says an engine died (it then waits on the proxy).
        deadline = time.monotonic() + 400
        while proc.poll() is None and "died" not in output.read_text() \
                and time.monotonic() < deadline:
            time.sleep(1)
        out = output.read_text()
        logs = "\n".join(_log_summary(p) for p in sorted((tmp_path / "logs").glob("*.log")))
        assert proc.returncode == 0 and "died" not in out, out + logs
        yield f"http://127.0.0.1:{port}", colocated_url, out
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                os.killpg(proc.pid, 0)
                time.sleep(0.5)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_the_cpu_recipe_serves_p_to_d_with_reuse_equal_to_a_colocated_engine(recipe,
                                                                              tiny_model):
    proxy, colocated, out = recipe
    # The recipe serves the model as NAME, the session's co-located server under its
    # path: the same model in float32.
    # The recipe's short turn: D alone, as the doc says of the defaults.
    assert re.search(r"(?im)^x-sessionkv-route: decode_only", out), out
    assert re.search(r"(?im)^x-sessionkv-route-reason: .*; decode only: \d+ uncached tokens",
                     out), out
    messages = [{"role": "system", "content": _words(40, 1)},
                {"role": "user", "content": _words(300, 2)}]
    session = {"X-Session-ID": "recipe-session"}
    first = post(proxy, "/v1/chat/completions", chat_body(NAME, messages, 64), session)
    assert first.headers["x-sessionkv-route"] == "disaggregated", first.headers
    assert_same(first, post(colocated, "/v1/chat/completions",
                            chat_body(tiny_model, messages, 64)), "turn 1")
    messages += [{"role": "assistant", "content": first.text},
                 {"role": "user", "content": _words(300, 3)}]
    second = post(proxy, "/v1/chat/completions", chat_body(NAME, messages, 64), session)
    assert second.headers["x-sessionkv-route"] == "disaggregated", second.headers
    prefill = json.loads(second.headers["x-sessionkv-prefill"])
    # P's own cache holds turn 1's prompt; turn 1's answer comes from D.
    assert prefill["local_hit_tokens"] > 0 and prefill["pulled_from_peer_tokens"] > 0, prefill
    baseline = post(colocated, "/v1/chat/completions", chat_body(tiny_model, messages, 64))
    assert_same(second, baseline, "turn 2")
    # Negative control: the comparison tells answers to another prompt apart.
    other = messages[:-1] + [{"role": "user", "content": _words(300, 5)}]
    assert not compare(second, post(colocated, "/v1/chat/completions",
                                    chat_body(tiny_model, other, 64))).equal
