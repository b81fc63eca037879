"""Helpers shared by the benchmarks that start engines and routers (``router_bench.py``,
``agent_workload.py``): the side venv with vllm-router and the toy proxy's stack, port
allocation, waiting for other vLLM servers, router command lines and Prometheus
scraping (percentiles: sessionkv_bench.stats).

Top-level imports are the standard library only: the side venv's python (which has
matplotlib) imports the benchmarks to draw their figures.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import shlex
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCH_DIR = REPO / "benchmarks"
SIDE_VENV = BENCH_DIR / ".venv-router"
SIDE_PY = SIDE_VENV / "bin" / "python"
VLLM_ROUTER = SIDE_VENV / "bin" / "vllm-router"
SIDE_PACKAGES = ["vllm-router", "fastapi", "uvicorn[standard]", "httpx", "matplotlib"]
PORT_LO, PORT_HI = 30000, 31999
UCX_PORT_RANGE = "31900-31999"   # kept out of the pool: UCX listeners of the P/D engines
OTHER_VLLM = "vllm.entrypoints|api_server|local_cluster"
BLOCK_SIZE = 32
SESSION_HEADER = "X-Session-ID"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# =========================================================================== setup
def ensure_side_venv() -> None:
    """Create benchmarks/.venv-router with vllm-router and the toy proxy's stack.

    uvicorn[standard] rather than bare uvicorn: vLLM itself depends on
    fastapi[standard], so the toy proxy normally runs with uvloop and httptools."""
    if VLLM_ROUTER.exists() and SIDE_PY.exists():
        probe = subprocess.run([str(SIDE_PY), "-c", "import fastapi, uvicorn, httpx, "
                                "matplotlib, uvloop"], capture_output=True)
        if probe.returncode == 0:
            return
    log(f"creating {SIDE_VENV} (vllm-router, fastapi, uvicorn, httpx, matplotlib)")
    if not SIDE_PY.exists():
        subprocess.run([sys.executable, "-m", "venv", str(SIDE_VENV)], check=True)
    subprocess.run([str(SIDE_PY), "-m", "pip", "install", "-q", *SIDE_PACKAGES], check=True)


def call_in_side_venv(module: str, func: str, *args: str) -> str | None:
    """``module.func(*args)`` (a benchmark's plot: matplotlib lives in the side venv)
    run by the side venv's python with benchmarks/ as its PYTHONPATH; the error output when
    it failed, else None."""
    out = subprocess.run([str(SIDE_PY), "-c",
                          "import importlib, sys; getattr(importlib.import_module(sys.argv[1]), "
                          "sys.argv[2])(*sys.argv[3:])", module, func, *args],
                         env={**os.environ, "PYTHONPATH": str(BENCH_DIR)},
                         capture_output=True, text=True, check=False)
    return out.stderr[-1500:] if out.returncode else None


class PortPool:
    """Free ports from 30000-31999 (the UCX range excluded), never handed out twice."""

    def __init__(self, lo: int = PORT_LO, hi: int = int(UCX_PORT_RANGE.split("-")[0]) - 1):
        self._next, self._hi = lo, hi

    @staticmethod
    def _free(port: int) -> bool:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                return False
        return True

    def take(self, n: int = 1) -> int:
        """The first of ``n`` consecutive free ports."""
        while self._next + n - 1 <= self._hi:
            start = self._next
            self._next += 1
            if all(self._free(p) for p in range(start, start + n)):
                self._next = start + n
                return start
        raise RuntimeError(f"no {n} consecutive free ports left in {PORT_LO}-{self._hi}")


def wait_for_no_other_vllm(max_wait_s: float) -> None:
    """Only one vLLM cluster may run on this machine: wait for others to finish."""
    waited = 0.0
    while True:
        out = subprocess.run(["pgrep", "-f", OTHER_VLLM], capture_output=True, text=True)
        pids = [int(p) for p in out.stdout.split() if int(p) != os.getpid()]
        if not pids:
            return
        if waited >= max_wait_s:
            raise TimeoutError(f"other vLLM processes still running after {waited:.0f}s: "
                               f"{pids[:8]}")
        log(f"waiting for other vLLM processes to finish ({len(pids)} running, "
            f"{waited:.0f}s so far)")
        time.sleep(30)
        waited += 30


def machine_line() -> str:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{os.cpu_count()} cores ({cpu}), {mem_gib:.0f} GiB RAM, "
            f"{platform.system()} {platform.release()}, load average {load} at start")


def python_build(python: str) -> dict:
    """What a benchmark needs to say about an interpreter that runs a Python router:
    its version and how it was built.  The build matters: the same proxy code costs
    measurably less CPU on a distribution's CPython (Debian's links the interpreter
    into the executable) than on one built with pyenv's defaults (no
    ``--enable-optimizations``, the interpreter in ``libpython.so``), so a report names
    the one it ran on.  Exits when that interpreter cannot import the proxy."""
    probe = ("import json, platform, sys, sysconfig, sessionkv_proxy; "
             "args = sysconfig.get_config_var('CONFIG_ARGS') or ''; "
             "print(json.dumps({'executable': sys.executable, "
             "'version': platform.python_version(), 'prefix': sys.base_prefix, "
             "'compiler': platform.python_compiler(), "
             "'enable_optimizations': '--enable-optimizations' in args, "
             "'libpython_so': any('libpython' in line for line in open('/proc/self/maps'))"
             "}))")
    out = subprocess.run([python, "-c", probe], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{python} cannot run the proxy ({out.stderr.strip()[-300:]}); "
                         "install it there: <python> -m pip install -e '.[proxy]'")
    return json.loads(out.stdout)


def python_line(info: dict) -> str:
    """One line for a report, e.g. ``CPython 3.11.2 from /usr (GCC 12.2.0; the
    interpreter linked into the executable)``."""
    where = ("in libpython.so" if info["libpython_so"]
             else "linked into the executable")
    opt = "; configured --enable-optimizations" if info["enable_optimizations"] else ""
    return (f"CPython {info['version']} from {info['prefix']} ({info['compiler']}; the "
            f"interpreter {where}{opt})")


# =========================================================================== routers
@dataclass
class Backend:
    url: str
    events: str | None = None     # tcp://127.0.0.1:PORT, the engine's KV-event publisher
    replay: str | None = None


@dataclass
class RouterProc:
    arm: str
    url: str
    proc: object                  # vllm_sessionkv.dev.launch.ManagedProcess
    argv: list[str]

    @property
    def pid(self) -> int:
        return self.proc.pid


def router_argv(kind: str, port: int, decode: list[Backend], ports: PortPool,
                prefill: list[Backend] | None = None, python: str | None = None
                ) -> list[str]:
    """The command line of one router.  ``kind``: ours, ours-notok, ours-text, toy,
    vr:<policy>, vr-pd[:<policy>], bare (the no-logic relay floor, one backend).
    ``python`` runs ours and bare (default: this interpreter); it must import
    ``sessionkv_proxy``."""
    urls = [b.url for b in decode]
    python = python or sys.executable
    if kind in ("ours", "ours-notok", "ours-text"):
        argv = [python, "-m", "sessionkv_proxy", "--host", "127.0.0.1",
                "--port", str(port), "--block-size", str(BLOCK_SIZE)]
        if kind == "ours-notok":
            # Routes on load only for text prompts: no /tokenize call per request.
            argv += ["--tokenizer", "none"]
        elif kind == "ours-text":
            # Keys over the prompt's text, matched against its own routes (as
            # vllm-router's cache_aware): no /tokenize, and no KV events (the proxy
            # refuses them with text keys), so the engines go by URL alone.
            argv += ["--tokenizer", "text"]
            decode = [Backend(b.url) for b in decode]
            prefill = [Backend(b.url) for b in prefill or []]
        # Extra flags for our proxy, e.g. ROUTER_BENCH_OURS_ARGS="--log-level DEBUG"
        # to see each routing decision in its log.
        argv += shlex.split(os.environ.get("ROUTER_BENCH_OURS_ARGS", ""))
        for flag, group in (("--prefill", prefill or []), ("--decode", decode)):
            for b in group:
                spec = f"url={b.url},events={b.events},replay={b.replay}" if b.events else b.url
                argv += [flag, spec]
        return argv
    if kind == "bare":
        return [python, str(BENCH_DIR / "bare_relay.py"), "--port", str(port),
                "--backend", urls[0]]
    if kind == "toy":
        argv = [str(SIDE_PY), str(BENCH_DIR / "toy_proxy.py"), "--port", str(port)]
        for b in prefill or []:
            argv += ["--prefill", b.url]
        for url in urls:
            argv += ["--decode", url]
        return argv
    # vllm-router serves Prometheus on its own port (default 29000): keep it in range.
    common = [str(VLLM_ROUTER), "--host", "127.0.0.1", "--port", str(port),
              "--prometheus-port", str(ports.take())]
    if kind.startswith("vr:"):
        return common + ["--policy", kind[3:], "--worker-urls", *urls]
    if kind == "vr-pd" or kind.startswith("vr-pd:"):
        # vr-pd:<policy> picks vllm-router's policy (round_robin by default).
        policy = kind.split(":", 1)[1] if ":" in kind else "round_robin"
        argv = common + ["--vllm-pd-disaggregation", "--policy", policy,
                         "--kv-connector", "nixl"]
        for b in prefill or []:
            argv += ["--prefill", b.url]
        for url in urls:
            argv += ["--decode", url]
        return argv
    raise ValueError(kind)


def start_routers(specs: list[tuple[str, str, list[Backend], list[Backend] | None]],
                  ports: PortPool, log_dir: Path, procs: list, python: str | None = None
                  ) -> dict[str, RouterProc]:
    """Start (arm, kind, decode, prefill) routers, wait until each /health is 200.
    ``python``: the interpreter of the Python routers (``router_argv``)."""
    from vllm_sessionkv.dev.launch import start_process, wait_healthy

    out: dict[str, RouterProc] = {}
    for arm, kind, decode, prefill in specs:
        port = ports.take()
        argv = router_argv(kind, port, decode, ports, prefill, python)
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", arm)
        proc = start_process(name, argv, log_dir, env=dict(os.environ))
        procs.append(proc)
        out[arm] = RouterProc(arm, f"http://127.0.0.1:{port}", proc, argv)
    wait_healthy([(r.proc, r.url) for r in out.values()], timeout_s=120)
    return out


def _med(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def metric_sums(url: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sum each named Prometheus sample over its label sets; absent names are left out."""
    import requests

    text = requests.get(url + "/metrics", timeout=30).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            try:
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            except ValueError:
                pass
    return out


def metric_sum(url: str, name: str) -> float:
    """One Prometheus sample's value summed over its label sets (0 when absent)."""
    return metric_sums(url, (name,)).get(name, 0.0)


def histogram_sums(url: str) -> dict[str, float]:
    """Sum and count of the histograms we read, summed over label sets."""
    wanted = ("vllm:request_time_per_output_token_seconds", "vllm:request_prefill_time_seconds")
    out: dict[str, float] = {}
    import requests

    text = requests.get(url + "/metrics", timeout=10).text
    for line in text.splitlines():
        for name in wanted:
            for suffix in ("_sum", "_count"):
                if line.startswith(name + suffix):
                    out[name + suffix] = out.get(name + suffix, 0.0) + float(line.split()[-1])
    return out


def histogram_mean(before: dict, after: dict, name: str) -> float | None:
    count = after.get(name + "_count", 0) - before.get(name + "_count", 0)
    if count <= 0:
        return None
    return (after.get(name + "_sum", 0) - before.get(name + "_sum", 0)) / count


def histogram_buckets(url: str, name: str) -> dict[float, float]:
    """A Prometheus histogram's cumulative bucket counts, ``le`` -> count, summed
    over its other labels."""
    import requests

    out: dict[float, float] = {}
    for line in requests.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "_bucket{") and 'le="' in line:
            le = float(line.split('le="', 1)[1].split('"', 1)[0])
            out[le] = out.get(le, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def histogram_quantile(buckets: dict[float, float], q: float) -> float | None:
    """Prometheus's estimate: linear within the bucket the quantile falls in (the
    lower bound of the first bucket is 0; past the last finite bound, that bound)."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * ((rank - below) / (count - below) if count > below
                                           else 1.0)
        lower, below = le, count
    return lower


def reset_prefix_caches(urls: list[str]) -> None:
    """Reset each engine's prefix cache, session holds included (``reset_external``).

    vLLM answers HTTP 200 either way; ``{"success": false}`` in the body means the
    cache was not reset (blocks still in use), so that is what is checked."""
    import requests

    for url in urls:
        for _ in range(100):
            resp = requests.post(url + "/reset_prefix_cache",
                                 params={"reset_external": "true"}, timeout=30)
            resp.raise_for_status()
            if resp.json().get("success") is True:
                break
            time.sleep(0.2)   # refused while requests still hold blocks
        else:
            raise RuntimeError(f"{url}/reset_prefix_cache kept answering {resp.text}")


# ------------------------------------------------------------ engine counters
def engine_counters(url: str) -> dict[str, float]:
    """Every ``sessionkv_*`` and ``vllm:nixl_*`` counter (and histogram count and sum)
    of one engine, summed over label sets that differ only in engine and model.
    Keys: ``name{label=value,...}``."""
    import requests

    types: dict[str, str] = {}
    out: dict[str, float] = {}
    for line in requests.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind.strip()
            continue
        if not line or line.startswith("#"):
            continue
        if not line.startswith(("sessionkv_", "vllm:nixl_")):
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        family = next((f for f in (name, name.removesuffix("_total"),
                                   name.removesuffix("_count"), name.removesuffix("_sum"))
                       if f in types), name)
        kind = types.get(family, "untyped")
        if kind == "gauge" or name.endswith(("_created", "_bucket")):
            continue
        if kind == "histogram" and not name.endswith(("_count", "_sum")):
            continue
        kept = []
        for pair in labels.rstrip("}").split(","):
            key, _, val = pair.partition("=")
            if key and key not in ("engine", "model_name"):
                kept.append(f"{key}={val.strip(chr(34))}")
        key = name + ("{" + ",".join(kept) + "}" if kept else "")
        try:
            out[key] = out.get(key, 0.0) + float(value)
        except ValueError:
            pass
    return out


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What each counter of :func:`engine_counters` moved by (only those that moved)."""
    return {k: round(v - before.get(k, 0.0), 6) for k, v in sorted(after.items())
            if round(v - before.get(k, 0.0), 6)}


def counter_sum(counters: dict[str, float], *needles: str) -> float:
    """The counters whose key holds every needle, summed."""
    return sum(v for k, v in counters.items() if all(n in k for n in needles))


def counters_by_label(counters: dict[str, float], name: str) -> dict[str, float]:
    """``name{label=x}`` -> {x: value}."""
    out: dict[str, float] = {}
    for key, value in counters.items():
        if key.startswith(name + "{"):
            label = key[len(name) + 1:-1].split("=", 1)[-1]
            out[label] = out.get(label, 0.0) + value
    return out
