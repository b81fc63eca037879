"""A package index on loopback (PEP 503 pages, PEP 658 metadata) serving given wheels.

It stands in for PyTorch's CPU wheel index where that index cannot be reached (as on
this project's machines), so that an install can be tried as on a machine that reaches
only PyPI and PyTorch's CPU index: point ``SESSIONKV_TORCH_INDEX_URL`` at it and hide
pip's local sources (``PIP_CONFIG_FILE=/dev/null``; ``ci/simulate_fresh_machine.sh
--public-index`` does both).

    python ci/wheel_index.py [--port N] WHEEL...     prints "INDEX <url>", then serves

Each wheel is served with its metadata file beside it (``data-core-metadata``), so a
resolution (``pip install --dry-run``) reads the metadata and never the wheel.
``WheelIndex.from_installed`` serves a distribution's metadata from an installed copy
without the wheel file (a request for the wheel then gets a 404 and is recorded in
``requests``): ``tests/unit/test_ci_install.py`` resolves the install against it.
"""

from __future__ import annotations

import argparse
import hashlib
import html
import http.server
import importlib.metadata
import re
import shutil
import threading
import urllib.parse
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Wheel:
    filename: str
    metadata: bytes
    path: Path | None       # None: metadata only (the wheel's request is a 404)

    @property
    def project(self) -> str:
        return re.sub(r"[-_.]+", "-", self.filename.split("-")[0]).lower()

    @classmethod
    def from_file(cls, path: str | Path) -> Wheel:
        path = Path(path)
        with zipfile.ZipFile(path) as zf:
            name = next(n for n in zf.namelist()
                        if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
            return cls(path.name, zf.read(name), path)


class WheelIndex:
    """``url`` is the index's root (``.../simple``); ``requests`` every path asked for."""

    def __init__(self, wheels: list[Wheel], host: str = "127.0.0.1", port: int = 0):
        self.wheels = {w.filename: w for w in wheels}
        self.requests: list[str] = []
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                index.requests.append(self.path)
                body = index._answer(urllib.parse.unquote(self.path.split("?")[0]))
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                size = body.stat().st_size if isinstance(body, Path) else len(body)
                page = isinstance(body, bytes) and body.startswith(b"<!DOCTYPE")
                self.send_header("Content-Type",
                                 "text/html" if page else "application/octet-stream")
                self.send_header("Content-Length", str(size))
                self.end_headers()
                if isinstance(body, Path):
                    with open(body, "rb") as f:
                        shutil.copyfileobj(f, self.wfile)
                else:
                    self.wfile.write(body)

            def log_message(self, *args):
                pass

        self._server = http.server.ThreadingHTTPServer((host, port), Handler)
        self.url = f"http://{host}:{self._server.server_address[1]}/simple"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @classmethod
    def from_installed(cls, distribution: str) -> WheelIndex:
        """The installed ``distribution``'s metadata under its wheel's file name."""
        dist = importlib.metadata.distribution(distribution)
        tag = next(line.split(": ", 1)[1] for line in dist.read_text("WHEEL").splitlines()
                   if line.startswith("Tag: "))
        name = dist.metadata["Name"].replace("-", "_")
        return cls([Wheel(f"{name}-{dist.version}-{tag}.whl",
                          dist.read_text("METADATA").encode(), None)])

    def _answer(self, path: str) -> bytes | Path | None:
        parts = [p for p in path.split("/") if p]
        if len(parts) == 2 and parts[0] == "simple":
            links = "".join(
                f'<a href="/files/{urllib.parse.quote(w.filename)}" data-core-metadata='
                f'"sha256={hashlib.sha256(w.metadata).hexdigest()}">'
                f"{html.escape(w.filename)}</a><br>\n"
                for w in self.wheels.values() if w.project == parts[1].lower())
            return f"<!DOCTYPE html><html><body>\n{links}</body></html>\n".encode() \
                if links else None
        if len(parts) == 2 and parts[0] == "files":
            if parts[1].endswith(".metadata") and parts[1][:-9] in self.wheels:
                return self.wheels[parts[1][:-9]].metadata
            wheel = self.wheels.get(parts[1])
            if wheel is not None and wheel.path is not None:
                return wheel.path
        return None

    def __enter__(self) -> WheelIndex:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("wheels", nargs="+", metavar="WHEEL")
    args = parser.parse_args(argv)
    with WheelIndex([Wheel.from_file(w) for w in args.wheels], port=args.port) as index:
        print(f"INDEX {index.url}", flush=True)
        threading.Event().wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
