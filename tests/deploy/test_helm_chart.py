"""deploy/helm/vllm-sessionkv: rendered by helm, validated against Kubernetes' schemas,
and consistent with what the engines and the proxy actually accept.

Four renderings: the default values, ``ci/external-redis-values.yaml`` (external
Redis from a Secret, a ServiceMonitor, UCX over TCP, tensor parallelism, early decode
off, proxy config keys), ``ci/cpu-values.yaml`` (the CPU recipe: Guaranteed engine
pods on whole cores, no GPU) and ``ci/secure-values.yaml`` (API keys and the side
ports' secret from Secrets, proxy TLS, the NetworkPolicy).  Helm comes from ``ci/install_chart_tools.py``; the schemas
from kubernetes-validate (PyPI), strict mode, at the chart's oldest Kubernetes (1.27)
and the newest the tool ships; the ServiceMonitor and the PrometheusRule (CRDs, unknown
to that tool) against the prometheus-operator schemas in
@kubernetes-models/prometheus-operator (npm).  The alert rules' expressions and the
Grafana dashboard's queries are parsed with Prometheus' PromQL grammar
(@prometheus-io/lezer-promql, npm), and every series they name must be one the proxy or
the connector registers (never ``rate()`` over a gauge); every alert has its section in
docs/operations.md's runbook.  Each engine's command line goes through vLLM's own
argument parser, its connector config through ours, and the proxy's config file
through the proxy's loader.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from helpers import metric_names

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "vllm-sessionkv"
NAMESPACE = "llm"
RELEASE = "skv"
VALUES = {"default": None, "external-redis": CHART / "ci" / "external-redis-values.yaml",
          "cpu": CHART / "ci" / "cpu-values.yaml", "secure": CHART / "ci" / "secure-values.yaml"}
# The chart's kubeVersion floor, and the newest schemas kubernetes-validate ships.
KUBERNETES_VERSIONS = ("1.27.0", "1.37.0")
# Stand-ins for what the kubelet puts in the downward-API variables.
POD_IP = "192.0.2.10"
REDIS_URL_FROM_SECRET = "redis://:secret@redis.example:6379/0"


@pytest.fixture(scope="module")
def helm() -> str:
    path = shutil.which("helm")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("helm is not installed: ci/install.sh runs ci/install_chart_tools.py")
        pytest.skip("helm is not installed (python ci/install_chart_tools.py)")
    return path


def _render(helm: str, values: Path | None, *extra: str) -> subprocess.CompletedProcess:
    argv = [helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *extra]
    if values is not None:
        argv += ["--values", str(values)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module", params=sorted(VALUES))
def rendered(request, helm) -> tuple[str, list[dict]]:
    done = _render(helm, VALUES[request.param])
    assert done.returncode == 0, done.stderr
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    assert docs
    return request.param, docs


def _kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def _named(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = [d for d in _kind(docs, kind) if d["metadata"]["name"] == name]
    return doc


def _values(name: str) -> dict:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    if VALUES[name] is not None:
        values = _deep_merge(values, yaml.safe_load(VALUES[name].read_text()))
    return values


def _deep_merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        out[key] = (_deep_merge(base[key], value)
                    if isinstance(value, dict) and isinstance(base.get(key), dict) else value)
    return out


def _expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion; a name not in ``env`` is left as it is."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: env.get(m.group(1), m.group(0)), text)


def _from_secret(name: str, key: str) -> str:
    """The stand-in for key ``key`` of Secret ``name``: a valid bearer token and side
    port secret (visible ASCII, no spaces, 16 characters or more)."""
    return f"secret:{name}/{key}"


def _container_env(pod_spec: dict, container: dict, pod_name: str) -> dict[str, str]:
    """Each env var's value as the kubelet sets it: downward API and Secrets filled
    with stand-ins, and a $(VAR) expanded only from variables listed before it (as
    the kubelet does); an unresolvable reference fails the test."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            value = _expand(var["value"], env)
        else:
            source = var["valueFrom"]
            if "fieldRef" in source:
                value = {"metadata.name": pod_name,
                         "status.podIP": POD_IP}[source["fieldRef"]["fieldPath"]]
            else:
                ref = source["secretKeyRef"]
                value = REDIS_URL_FROM_SECRET if var["name"] == "SESSIONKV_REDIS_URL" \
                    else _from_secret(ref["name"], ref["key"])
        assert "$(" not in value, f"{var['name']}={value}: refers to a variable not set before it"
        env[var["name"]] = value
    return env


def _documented_keys() -> set[str]:
    """The keys the README's Values table names, spelled out: ``a.b.c``, ``.d`` (a
    sibling of the key before it), ``prefill/decode.x`` (both), ``a.b.*`` (all under
    a.b)."""
    table = (CHART / "README.md").read_text().split("\n## Values\n", 1)[1].split("\n## ", 1)[0]
    keys: set[str] = set()
    for row in re.findall(r"^\| (`.+?) \|", table, re.M):
        parent = ""
        for key in re.findall(r"`([^`]+)`", row):
            if key.startswith("."):
                key = parent + key
            parent = key.rsplit(".", 1)[0]
            head, dot, rest = key.removesuffix(".*").partition(".")
            keys.update(h + dot + rest for h in head.split("/"))
    return keys


def _leaf_keys(values: dict, prefix: str = "") -> set[str]:
    keys: set[str] = set()
    for key, value in values.items():
        path = prefix + key
        keys |= _leaf_keys(value, path + ".") if isinstance(value, dict) and value else {path}
    return keys


def test_every_value_is_described_in_the_readme():
    """Each key of values.yaml is in the README's Values table (itself or a key above
    it), and each key the table names is in values.yaml."""
    documented = _documented_keys()
    leaves = _leaf_keys(yaml.safe_load((CHART / "values.yaml").read_text()))
    undocumented = sorted(leaf for leaf in leaves
                          if not any(leaf == d or leaf.startswith(d + ".") for d in documented))
    assert undocumented == []
    stale = sorted(d for d in documented
                   if not any(leaf == d or leaf.startswith(d + ".") for leaf in leaves))
    assert stale == []


def test_chart_lints_strictly(helm):
    for values in VALUES.values():
        argv = [helm, "lint", "--strict", str(CHART)]
        if values is not None:
            argv += ["--values", str(values)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr


def test_manifests_validate_against_kubernetes_schemas(rendered):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    name, docs = rendered
    checked: set[str] = set()
    for doc in docs:
        if doc["kind"] in ("ServiceMonitor", "PrometheusRule"):
            continue  # CRDs: validated against the operator's schemas below
        for version in KUBERNETES_VERSIONS:
            # Raises kubernetes_validate.ValidationError with the path of a bad field.
            kubernetes_validate.validate(doc, version, strict=True)
        checked.add(doc["kind"])
    expected = {"ConfigMap", "Deployment", "Service", "StatefulSet"}
    if _values(name)["proxy"]["replicas"] > 1:
        expected.add("PodDisruptionBudget")
    if _values(name)["networkPolicy"]["enabled"]:
        expected.add("NetworkPolicy")
    assert expected <= checked


def _chart_tool(*parts: str) -> Path:
    """A file of the npm packages ci/install_chart_tools.py installs (skip, or fail in
    CI, without them or node)."""
    import sys

    path = Path(sys.prefix, "share", "chart-tools", "node_modules", *parts)
    if shutil.which("node") is None or not path.is_file():
        if os.environ.get("CI"):
            pytest.fail(f"node or {path} is missing: ci/install.sh runs "
                        "ci/install_chart_tools.py")
        pytest.skip(f"{path} is not installed (python ci/install_chart_tools.py)")
    return path


def _node(script: str, module: Path, payload: list) -> list[str | None]:
    done = subprocess.run([shutil.which("node"), str(Path(__file__).with_name(script)),
                           str(module)], input=json.dumps(payload), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _validate_crds(docs: list[dict], kind: str) -> list[str | None]:
    """The validator's message per object of a prometheus-operator kind (None: valid)."""
    model = _chart_tool("@kubernetes-models", "prometheus-operator", "monitoring.coreos.com",
                        "v1", f"{kind}.js")
    return _node("validate_crd.mjs", model, docs)


def test_service_monitor_validates_against_the_operators_schema(helm):
    docs = [d for d in yaml.safe_load_all(
        _render(helm, VALUES["external-redis"]).stdout) if d]
    monitors = _kind(docs, "ServiceMonitor")
    assert len(monitors) == 1
    wrong = json.loads(json.dumps(monitors[0]))
    wrong["spec"]["endpoints"][0]["port"] = 8000  # the schema wants the port's name
    assert _validate_crds(monitors + [wrong], "ServiceMonitor") == [
        None, "data/spec/endpoints/0/port must be string"]


def test_a_manifest_with_a_wrong_field_fails_validation(helm):
    """The validator is not a no-op: a misspelled field and a wrong type fail it."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    docs = [d for d in yaml.safe_load_all(_render(helm, None).stdout) if d]
    sts = _kind(docs, "StatefulSet")[0]
    sts["spec"]["replica"] = sts["spec"].pop("replicas")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, KUBERNETES_VERSIONS[-1], strict=True)
    svc = _kind(docs, "Service")[0]
    svc["spec"]["ports"][0]["port"] = "http"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(svc, KUBERNETES_VERSIONS[-1], strict=True)


def _proxy_config(docs: list[dict]) -> tuple[dict, dict]:
    prefix = f"{RELEASE}-vllm-sessionkv"
    config = json.loads(_named(docs, "ConfigMap", f"{prefix}-proxy")["data"]["proxy.json"])
    deployment = _named(docs, "Deployment", f"{prefix}-proxy")
    return config, deployment


def test_proxy_config_and_flags_load_as_the_proxy_loads_them(rendered, tmp_path,
                                                             monkeypatch):
    from sessionkv_proxy.__main__ import _parser
    from sessionkv_proxy.config import SECRET_ENV, Role, load_config

    name, docs = rendered
    values = _values(name)
    raw, deployment = _proxy_config(docs)
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["sessionkv-proxy"]   # the proxy image's entry point
    env = _container_env(pod, container, "proxy-pod")
    args = _parser().parse_args([_expand(a, env) for a in container["args"]])
    mount = container["volumeMounts"][0]["mountPath"]
    assert args.config == f"{mount}/proxy.json"
    if values["proxy"]["tls"]["secretName"]:
        # The certificate and key the Secret volume holds, where the config names them.
        raw = {**raw, **_tls_files(pod, container, raw, tmp_path)}
    # The secrets reach load_config through the environment (SECRET_ENV), as in the pod.
    for variable in SECRET_ENV.values():
        monkeypatch.delenv(variable, raising=False)
        if variable in env:
            monkeypatch.setenv(variable, env[variable])
    path = tmp_path / "proxy.json"
    path.write_text(json.dumps(raw))
    config = load_config(str(path), {"index": {"backend": "redis", "redis_url": args.redis_url}})
    for key, variable in SECRET_ENV.items():
        assert getattr(config, key) == env.get(variable), key
    assert len(config.prefill) == values["prefill"]["replicas"]
    assert len(config.decode) == values["decode"]["replicas"]
    assert config.host == "0.0.0.0" and config.port == values["proxy"]["port"]
    assert config.block_size == values["model"]["blockSize"]
    for key, value in values["proxy"]["config"].items():
        assert raw[key] == value
    if name == "external-redis":
        assert config.index.redis_url == REDIS_URL_FROM_SECRET
        assert all(e.early_decode is None for e in config.engines)
        assert all(e.handle_channel is None for e in config.engines)
    else:
        assert config.index.redis_url == f"redis://{RELEASE}-vllm-sessionkv-redis:6379/0"
        _named(docs, "Service", f"{RELEASE}-vllm-sessionkv-redis")
        assert all(e.early_decode for e in config.engines if e.role is Role.DECODE)
        # Every D's handle channel, as the launcher gives it (``handles=`` in --decode).
        assert all(e.handle_channel for e in config.engines if e.role is Role.DECODE)
        assert all(e.handle_channel is None for e in config.engines
                   if e.role is not Role.DECODE)


def test_every_engine_the_proxy_names_is_a_pod_that_answers_to_that_name(rendered):
    """Engine URL, KV-event, early-decode and handle-channel endpoints in the proxy's
    config are the stable DNS names of the StatefulSets' pods behind their headless
    Services, on the ports those pods open; each engine advertises the same URL in its
    handles."""
    from urllib.parse import urlsplit

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import (
        make_arg_parser,
        validate_parsed_serve_args,
    )
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_sessionkv.config import parse_config

    name, docs = rendered
    values = _values(name)
    proxy_config, _ = _proxy_config(docs)
    by_url = {e["url"]: e for e in proxy_config["engines"]}
    assert len(by_url) == len(proxy_config["engines"])
    parser = make_arg_parser(FlexibleArgumentParser())
    seen: set[str] = set()
    for pool, role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        sts = _named(docs, "StatefulSet", f"{RELEASE}-vllm-sessionkv-{pool}")
        service = _named(docs, "Service", sts["spec"]["serviceName"])
        assert service["spec"]["clusterIP"] == "None"
        labels = sts["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items()
        pod = sts["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports)
        assert sts["spec"]["replicas"] == values[pool]["replicas"]
        for i in range(sts["spec"]["replicas"]):
            pod_name = f"{sts['metadata']['name']}-{i}"
            host = f"{pod_name}.{service['metadata']['name']}.{NAMESPACE}.svc.cluster.local"
            env = _container_env(pod, container, pod_name)
            assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == POD_IP
            assert int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) == ports["nixl-side"]
            # vLLM's own parser: an unknown flag or a bad config value exits here.
            cli = parser.parse_args([_expand(a, env) for a in container["args"]])
            validate_parsed_serve_args(cli)
            engine_args = AsyncEngineArgs.from_cli_args(cli)
            assert engine_args.model == values["model"]["name"]
            assert engine_args.block_size == values["model"]["blockSize"]
            assert engine_args.enable_prefix_caching
            assert engine_args.prefix_caching_hash_algo == "sha256"
            assert engine_args.tensor_parallel_size == values[pool]["tensorParallelSize"]
            transfer = engine_args.kv_transfer_config
            assert transfer.kv_connector == "SessionKVConnector"
            assert transfer.kv_role == role
            sessionkv = parse_config(transfer.kv_connector_extra_config)
            for key, value in values["engine"]["connector"]["nixl"].items():
                assert transfer.kv_connector_extra_config[key] == value
            engine = by_url[sessionkv.advertise_url]
            assert engine["role"] == pool
            assert urlsplit(engine["url"]).hostname == host
            assert urlsplit(engine["url"]).port == ports["http"]
            events = engine_args.kv_events_config
            assert events.enable_kv_cache_events and events.publisher == "zmq"
            assert engine["kv_events"] == f"tcp://{host}:{ports['kv-events']}"
            assert events.endpoint == f"tcp://*:{ports['kv-events']}"
            assert engine["kv_events_replay"] == f"tcp://{host}:{ports['kv-replay']}"
            assert events.replay_endpoint == f"tcp://*:{ports['kv-replay']}"
            assert engine["kv_events_topic"] == events.topic
            assert sessionkv.redis_url == env["SESSIONKV_REDIS_URL"]
            if sessionkv.early_decode_port:
                assert pool == "decode"
                assert ports["early-decode"] == sessionkv.early_decode_port
                assert engine["early_decode"] == f"tcp://{host}:{sessionkv.early_decode_port}"
            else:
                assert "early_decode" not in engine
            if sessionkv.handle_channel_port:
                assert pool == "decode"
                assert ports["handle-channel"] == sessionkv.handle_channel_port
                assert sessionkv.handle_channel_bind_host == "*"
                assert engine["handle_channel"] == \
                    f"tcp://{host}:{sessionkv.handle_channel_port}"
            else:
                assert "handle_channel" not in engine
            seen.add(engine["url"])
    assert seen == set(by_url)


def test_probes_name_ports_the_containers_open(rendered):
    _, docs = rendered
    for doc in _kind(docs, "StatefulSet") + _kind(docs, "Deployment"):
        for container in doc["spec"]["template"]["spec"]["containers"]:
            ports = {p["name"] for p in container["ports"]}
            probes = [container[k] for k in ("startupProbe", "readinessProbe", "livenessProbe")
                      if k in container]
            assert len(probes) >= 2, doc["metadata"]["name"]
            for probe in probes:
                action = probe.get("httpGet") or probe.get("tcpSocket")
                if action is not None:
                    assert action["port"] in ports, (doc["metadata"]["name"], probe)


def test_service_monitor_selects_the_engines_and_the_proxy_on_their_metrics_port(helm):
    docs = [d for d in yaml.safe_load_all(
        _render(helm, VALUES["external-redis"]).stdout) if d]
    (monitor,) = _kind(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    selector = monitor["spec"]["selector"]
    (expression,) = selector["matchExpressions"]
    selected = [s for s in _kind(docs, "Service")
                if selector["matchLabels"].items() <= s["metadata"]["labels"].items()
                and s["metadata"]["labels"].get(expression["key"]) in expression["values"]]
    assert sorted(s["metadata"]["labels"]["app.kubernetes.io/component"]
                  for s in selected) == ["decode", "prefill", "proxy"]
    for doc in _kind(docs, "StatefulSet") + _kind(docs, "Deployment"):
        assert "prometheus.io/scrape" not in doc["spec"]["template"]["metadata"]["annotations"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    for service in selected:
        assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    # Off by default, and the scrape annotations then are on every engine and proxy pod.
    default = [d for d in yaml.safe_load_all(_render(helm, None).stdout) if d]
    assert not _kind(default, "ServiceMonitor")
    for doc in _kind(default, "StatefulSet") + _kind(default, "Deployment"):
        if doc["metadata"]["labels"]["app.kubernetes.io/component"] == "redis":
            continue
        annotations = doc["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/path"] == "/metrics"


def test_several_proxies_without_redis_is_refused_at_render_time(helm):
    done = _render(helm, None, "--set", "redis.bundled.enabled=false")
    assert done.returncode != 0
    assert "proxy.replicas > 1 needs Redis" in done.stderr
    one = _render(helm, None, "--set", "redis.bundled.enabled=false",
                  "--set", "proxy.replicas=1")
    assert one.returncode == 0, one.stderr
    docs = [d for d in yaml.safe_load_all(one.stdout) if d]
    raw, deployment = _proxy_config(docs)
    assert "index" not in raw
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not any(a.startswith("--redis-url") for a in args)


def test_cpu_recipe_engines_are_guaranteed_on_whole_cores_without_gpus(helm):
    """The kubelet's static CPU manager gives a pod cores of its own only when it is
    Guaranteed with whole CPUs; vLLM then binds the model threads inside them."""
    done = _render(helm, VALUES["cpu"])
    assert done.returncode == 0, done.stderr
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    for pool in ("prefill", "decode"):
        sts = _named(docs, "StatefulSet", f"{RELEASE}-vllm-sessionkv-{pool}")
        (container,) = sts["spec"]["template"]["spec"]["containers"]
        resources = container["resources"]
        assert "nvidia.com/gpu" not in resources["limits"]
        assert resources["requests"]["cpu"] == resources["limits"]["cpu"]
        assert str(resources["limits"]["cpu"]).isdigit()
        assert resources["requests"]["memory"] == resources["limits"]["memory"]
        env = {v["name"]: v.get("value") for v in container["env"]}
        assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"



# ------------------------------------------------------- secrets, TLS, NetworkPolicy

SECURE = VALUES["secure"]
_AUTH_ENV = {"proxy": {"SESSIONKV_PROXY_API_KEY": "apiKeySecret",
                       "SESSIONKV_ENGINE_API_KEY": "engineApiKeySecret",
                       "SESSIONKV_SIDE_PORT_SECRET": "sidePortSecret"},
             "engine": {"VLLM_API_KEY": "engineApiKeySecret",
                        "SESSIONKV_SIDE_PORT_SECRET": "sidePortSecret"}}


def _docs(helm, values: Path | None, *extra: str) -> list[dict]:
    done = _render(helm, values, *extra)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def _self_signed(cert: Path, key: Path) -> None:
    cert.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)


def _tls_files(pod: dict, container: dict, raw: dict, tmp_path: Path) -> dict[str, str]:
    """The proxy's tls_cert_file and tls_key_file as files under ``tmp_path``: each must
    be a file the pod's Secret volume puts where the config names it."""
    files = {}
    for mount in container["volumeMounts"]:
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        for item in volume.get("secret", {}).get("items", []):
            files[f"{mount['mountPath']}/{item['path']}"] = (volume["secret"]["secretName"],
                                                             item["key"])
    assert raw["tls_cert_file"] in files and raw["tls_key_file"] in files, (raw, files)
    cert, key = (tmp_path / "tls" / files[raw[k]][1] for k in ("tls_cert_file",
                                                               "tls_key_file"))
    _self_signed(cert, key)
    return {"tls_cert_file": str(cert), "tls_key_file": str(key)}


def _pods(docs: list[dict]) -> dict[str, tuple[dict, dict]]:
    """Each component's pod template and its (only) container."""
    pods = {}
    for doc in _kind(docs, "StatefulSet") + _kind(docs, "Deployment"):
        template = doc["spec"]["template"]
        (container,) = template["spec"]["containers"]
        pods[template["metadata"]["labels"]["app.kubernetes.io/component"]] = \
            (template, container)
    return pods


def _secret_refs(container: dict) -> dict[str, tuple[str, str]]:
    return {v["name"]: (v["valueFrom"]["secretKeyRef"]["name"],
                        v["valueFrom"]["secretKeyRef"]["key"])
            for v in container.get("env", []) if "secretKeyRef" in v.get("valueFrom", {})}


def test_secrets_reach_the_proxy_and_the_engines_from_their_secrets_only(helm):
    """auth.*: each Secret's key reaches exactly the variables that read it, as a
    secretKeyRef, never a value or a command-line word; off by default."""
    values = _values("secure")
    docs = _docs(helm, SECURE)
    for component, (_, container) in _pods(docs).items():
        if component == "redis":
            continue
        refs = _secret_refs(container)
        wanted = _AUTH_ENV["proxy" if component == "proxy" else "engine"]
        for variable, value in wanted.items():
            ref = values["auth"][value]
            assert refs[variable] == (ref["name"], ref["key"]), (component, variable)
        assert not {"VLLM_API_KEY", "SESSIONKV_PROXY_API_KEY"} & set(refs) - set(wanted)
        assert not any("api-key" in a or "api_key" in a for a in container["args"])
    for component, (_, container) in _pods(_docs(helm, None)).items():
        names = {v["name"] for v in container.get("env", [])}
        assert not names & {*_AUTH_ENV["proxy"], *_AUTH_ENV["engine"]}, component


def test_engines_read_their_secrets_from_the_environment(helm, monkeypatch):
    """vLLM 0.32's server guards /v1/* with VLLM_API_KEY when no --api-key is given,
    and the connector takes side_port_secret from SESSIONKV_SIDE_PORT_SECRET: the
    chart's engine command lines, parsed by vLLM, with the pod's environment."""
    from fastapi import FastAPI
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware
    from vllm.entrypoints.serve.middleware.register import init_entrypoints_middleware
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_sessionkv.config import parse_config

    parser = make_arg_parser(FlexibleArgumentParser())
    for secure in (True, False):
        docs = _docs(helm, SECURE if secure else None)
        for pool in ("prefill", "decode"):
            template, container = _pods(docs)[pool]
            env = _container_env(template["spec"], container, f"{pool}-0")
            for variable in _AUTH_ENV["engine"]:
                monkeypatch.delenv(variable, raising=False)
                if variable in env:
                    monkeypatch.setenv(variable, env[variable])
            assert ("VLLM_API_KEY" in env) is secure
            cli = parser.parse_args([_expand(a, env) for a in container["args"]])
            assert cli.api_key is None
            app = FastAPI()
            init_entrypoints_middleware(cli, app, ())
            guarded = [m for m in app.user_middleware if m.cls is AuthenticationMiddleware]
            assert len(guarded) == int(secure), pool
            if secure:
                (token,) = guarded[0].kwargs["tokens"]
                assert token == env["VLLM_API_KEY"]
            transfer = AsyncEngineArgs.from_cli_args(cli).kv_transfer_config
            sessionkv = parse_config(transfer.kv_connector_extra_config)
            assert sessionkv.side_port_secret == env.get("SESSIONKV_SIDE_PORT_SECRET")
            assert (sessionkv.side_port_secret is not None) is secure


@pytest.mark.parametrize("settings, message", [
    (["auth.apiKeySecret.name=keys"],
     'auth.apiKeySecret.name is "keys" but auth.apiKeySecret.key is empty'),
    (["auth.engineApiKeySecret.key=engine"],
     'auth.engineApiKeySecret.key is "engine" but auth.engineApiKeySecret.name is empty'),
    (["auth.sidePortSecret.name=side"],
     'auth.sidePortSecret.name is "side" but auth.sidePortSecret.key is empty'),
    (["proxy.tls.secretName=tls", "proxy.tls.keyKey="],
     'proxy.tls.secretName is "tls" but proxy.tls.certKey or proxy.tls.keyKey is empty'),
    (["networkPolicy.enabled=true", "engine.ucx.tcpPortRange=5700:5799"],
     'engine.ucx.tcpPortRange must be PORT or FIRST-LAST'),
])
def test_a_half_set_secret_or_a_bad_port_range_fails_the_render(helm, settings, message):
    done = _render(helm, None, *[a for s in settings for a in ("--set", s)])
    assert done.returncode != 0
    assert message in done.stderr, done.stderr


def test_proxy_tls_probes_and_scrapes_over_https(helm):
    docs = _docs(helm, SECURE)
    template, container = _pods(docs)["proxy"]
    assert container["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert template["metadata"]["annotations"]["prometheus.io/scheme"] == "https"
    (volume,) = [v for v in template["spec"]["volumes"] if "secret" in v]
    assert volume["secret"]["secretName"] == "sessionkv-proxy-tls"
    assert {i["key"] for i in volume["secret"]["items"]} == {"tls.crt", "tls.key"}
    # Off by default: plain HTTP, the liveness probe a plain GET of /metrics.
    template, container = _pods(_docs(helm, None))["proxy"]
    assert container["readinessProbe"]["httpGet"]["scheme"] == "HTTP"
    assert container["livenessProbe"]["httpGet"] == {"path": "/metrics", "port": "http",
                                                     "scheme": "HTTP"}
    assert not any("secret" in v for v in template["spec"]["volumes"])
    raw, _ = _proxy_config(_docs(helm, None))
    assert "tls_cert_file" not in raw


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_the_liveness_probe_passes_a_keyed_tls_proxy_with_the_pods_key(helm, tmp_path):
    """Behind auth.apiKeySecret the proxy's /metrics wants the key, which an httpGet
    probe cannot take from a Secret: the chart's exec probe, run as the kubelet runs
    it against a real proxy with the key and TLS, passes with the pod's key and fails
    with another."""
    import asyncio

    from sessionkv_proxy.app import create_app
    from sessionkv_proxy.config import load_config

    port = _free_port()
    (_, container) = _pods(_docs(helm, SECURE, "--set", f"proxy.port={port}"))["proxy"]
    command = container["livenessProbe"]["exec"]["command"]
    timeout_s = container["livenessProbe"]["timeoutSeconds"]
    key = _from_secret("sessionkv-auth", "proxy-api-key")
    cert, tls_key = tmp_path / "cert.pem", tmp_path / "key.pem"
    _self_signed(cert, tls_key)
    proxy = create_app(load_config(None, {
        "engines": [{"url": f"http://127.0.0.1:{_free_port()}", "role": "decode"}],
        "host": "127.0.0.1", "port": port, "tokenizer": "none", "api_key": key,
        "tls_cert_file": str(cert), "tls_key_file": str(tls_key)}))
    await proxy.start()

    async def probe(sent: str) -> int:
        process = await asyncio.create_subprocess_exec(
            *[shutil.which("python3") if command[0] == "python3" else command[0],
              *command[1:]],
            env={**os.environ, "SESSIONKV_PROXY_API_KEY": sent},
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        return await asyncio.wait_for(process.wait(), timeout_s + 10)

    try:
        assert await probe(key) == 0
        assert await probe("not-the-key-0123456789") != 0
    finally:
        await proxy.stop(1.0)


def _selects(selector: dict, labels: dict) -> bool:
    """A LabelSelector (matchLabels, matchExpressions In/NotIn/Exists) over ``labels``."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        value = labels.get(expression["key"])
        operator = expression["operator"]
        if operator == "In" and value not in expression["values"]:
            return False
        if operator == "NotIn" and value in expression["values"]:
            return False
        if operator == "Exists" and value is None:
            return False
    return True


def _admitted(policies: list[dict], pod: dict, peer: dict, port: int) -> bool:
    """Whether the NetworkPolicies of the release let a pod of this namespace with
    labels ``peer`` reach ``port`` of a pod with labels ``pod`` (a pod no policy
    selects admits everything)."""
    selecting = [p for p in policies if _selects(p["spec"]["podSelector"], pod)]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            peers = rule.get("from")
            from_peer = peers is None or any(
                "podSelector" in p and "namespaceSelector" not in p
                and _selects(p["podSelector"], peer) for p in peers)
            on_port = "ports" not in rule or any(
                p["port"] <= port <= p.get("endPort", p["port"]) for p in rule["ports"])
            if from_peer and on_port:
                return True
    return False


def test_network_policy_admits_the_engines_ports_only_from_the_releases_pods(helm):
    """Every port an engine opens is reached by the pods that use it (the proxy: HTTP,
    KV events and replay, early decode, handle channel; the engines: NIXL's side
    channel, early decode, UCX's port range), by no other pod, and HTTP (/metrics)
    by Prometheus' peer; the bundled Redis by the proxy and the engines only.  Off
    by default."""
    assert not _kind(_docs(helm, None), "NetworkPolicy")
    values = _values("secure")
    docs = _docs(helm, SECURE)
    policies = _kind(docs, "NetworkPolicy")
    assert {p["metadata"]["name"] for p in policies} == {
        f"{RELEASE}-vllm-sessionkv-engines", f"{RELEASE}-vllm-sessionkv-redis"}
    pods = {component: template["metadata"]["labels"]
            for component, (template, _) in _pods(docs).items()}
    outsider = {**pods["proxy"], "app.kubernetes.io/instance": "another-release"}
    uses = {"http": {"proxy"}, "kv-events": {"proxy"}, "kv-replay": {"proxy"},
            "nixl-side": {"prefill", "decode"}, "early-decode": {"proxy", "prefill"},
            "handle-channel": {"proxy"}}
    first, last = map(int, values["engine"]["ucx"]["tcpPortRange"].split("-"))
    for pool in ("prefill", "decode"):
        _, container = _pods(docs)[pool]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert set(ports) <= set(uses)
        for name, port in ports.items():
            for peer in uses[name]:
                assert _admitted(policies, pods[pool], pods[peer], port), (pool, name, peer)
            assert not _admitted(policies, pods[pool], outsider, port), (pool, name)
            assert not _admitted(policies, pods[pool], pods["redis"], port), (pool, name)
        for port in (first, last):
            assert _admitted(policies, pods[pool], pods["decode"], port)
            assert not _admitted(policies, pods[pool], pods["proxy"], port)
        assert not _admitted(policies, pods[pool], pods["prefill"], last + 1)
    # Prometheus, from the namespace of metricsFrom: the HTTP port only.
    (engines,) = [p for p in policies if p["metadata"]["name"].endswith("-engines")]
    (metrics_rule,) = [r for r in engines["spec"]["ingress"]
                       if r["from"] == values["networkPolicy"]["metricsFrom"]]
    assert metrics_rule["ports"] == [{"protocol": "TCP", "port": values["engine"]["port"]}]
    redis_port = values["redis"]["bundled"]["port"]
    for peer in ("proxy", "prefill", "decode"):
        assert _admitted(policies, pods["redis"], pods[peer], redis_port)
    assert not _admitted(policies, pods["redis"], outsider, redis_port)
    # The proxy is the front door: no policy selects it.
    assert _admitted(policies, pods["proxy"], outsider, values["proxy"]["port"])
    # Without a UCX port range UCX listens on ephemeral ports: any port, engines only.
    docs = _docs(helm, SECURE, "--set", "engine.ucx.tcpPortRange=")
    policies = _kind(docs, "NetworkPolicy")
    assert _admitted(policies, pods["prefill"], pods["decode"], 40000)
    assert not _admitted(policies, pods["prefill"], pods["proxy"], 40000)


def test_service_monitors_scrape_a_keyed_tls_proxy_with_its_key(helm):
    """With the proxy's key or TLS, the proxy has its own ServiceMonitor that sends
    the key from its Secret over HTTPS; the engines' keeps plain HTTP."""
    values = _values("secure")
    docs = _docs(helm, SECURE)
    monitors = {m["metadata"]["name"]: m for m in _kind(docs, "ServiceMonitor")}
    engines, proxy = (monitors[f"{RELEASE}-vllm-sessionkv"],
                      monitors[f"{RELEASE}-vllm-sessionkv-proxy"])
    services = _kind(docs, "Service")

    def selected(monitor):
        selector = monitor["spec"]["selector"]
        return sorted(s["metadata"]["labels"]["app.kubernetes.io/component"]
                      for s in services if _selects(selector, s["metadata"]["labels"]))
    assert selected(engines) == ["decode", "prefill"]
    assert selected(proxy) == ["proxy"]
    (endpoint,) = proxy["spec"]["endpoints"]
    ref = values["auth"]["apiKeySecret"]
    assert endpoint["authorization"] == {"type": "Bearer", "credentials": {
        "name": ref["name"], "key": ref["key"]}}
    assert endpoint["scheme"] == "https"
    assert "scheme" not in engines["spec"]["endpoints"][0]
    assert _validate_crds(list(monitors.values()), "ServiceMonitor") == [None, None]


# ------------------------------------------------------------ alerts and the dashboard

DASHBOARD = REPO / "deploy" / "grafana" / "vllm-sessionkv.json"
OPERATIONS = REPO / "docs" / "operations.md"
# Grafana's range variables, as Prometheus would get them.
_GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h"}


def _rules(helm) -> list[dict]:
    docs = [d for d in yaml.safe_load_all(
        _render(helm, VALUES["external-redis"]).stdout) if d]
    (rule,) = _kind(docs, "PrometheusRule")
    return rule


def _alerts(rule: dict) -> list[dict]:
    return [r for group in rule["spec"]["groups"] for r in group["rules"]]


def _dashboard_queries() -> list[str]:
    exprs: list[str] = []

    def walk(panels: list[dict]) -> None:
        for panel in panels:
            exprs.extend(t["expr"] for t in panel.get("targets", []) if t.get("expr"))
            walk(panel.get("panels", []))

    walk(json.loads(DASHBOARD.read_text())["panels"])
    for variable, value in _GRAFANA_VARIABLES.items():
        exprs = [e.replace(variable, value) for e in exprs]
    return exprs


def _parse_promql(exprs: list[str]) -> list[str | None]:
    parser = _chart_tool("@prometheus-io", "lezer-promql", "dist", "index.es.js")
    return _node("parse_promql.mjs", parser, exprs)


def _ours(expr: str) -> set[str]:
    """The series of this project (the proxy's, the connector's and NIXL's) an
    expression names; vLLM's own ``vllm:*`` are checked on a live cluster
    (tests/e2e/test_deploy_observability.py)."""
    return {n for n in metric_names(expr) if n.startswith(("sessionkv_", "vllm:nixl_"))}


def _problems(exprs: list[str], series: dict[str, tuple[str, tuple]]) -> list[str]:
    """Names no registry exports, and rate()/irate()/increase() over a gauge."""
    suffixes = {"counter": ("",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    exported = {name + suffix: kind for name, (kind, _) in series.items()
                for suffix in suffixes[kind]}
    problems = []
    for expr in exprs:
        problems += [f"{name}: not registered ({expr})"
                     for name in sorted(_ours(expr) - set(exported))]
        for fn, name in re.findall(r"\b(rate|irate|increase)\s*\(\s*([a-zA-Z_:][\w:]*)", expr):
            if exported.get(name) == "gauge":
                problems.append(f"{fn}() over the gauge {name} ({expr})")
    return problems


def test_prometheus_rule_is_off_by_default_and_validates_against_the_operators_schema(helm):
    default = [d for d in yaml.safe_load_all(_render(helm, None).stdout) if d]
    assert not _kind(default, "PrometheusRule")
    rule = _rules(helm)
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    wrong = json.loads(json.dumps(rule))
    wrong["spec"]["groups"][0]["rules"][0]["for"] = 5   # the schema wants a duration
    results = _validate_crds([rule, wrong], "PrometheusRule")
    assert results[0] is None, results[0]
    assert results[1] and "for" in results[1], results[1]
    # Thresholds come from the values; every alert is scoped to the release's namespace.
    alerts = {a["alert"]: a for a in _alerts(rule)}
    assert "> 0.4" in alerts["SessionKVHoldsEndedForKVPressure"]["expr"]
    for alert in alerts.values():
        assert f'namespace="{NAMESPACE}"' in alert["expr"], alert["alert"]
        assert alert["labels"]["severity"] in {"critical", "warning", "info"}


def test_alert_and_dashboard_queries_parse_and_name_registered_series(helm):
    from helpers import connector_series, proxy_series

    exprs = [a["expr"] for a in _alerts(_rules(helm))] + _dashboard_queries()
    results = _parse_promql(exprs + ["sum(rate(sessionkv_proxy_requests_total[5m])"])
    assert results[-1] is not None                      # the parser's negative control
    assert {e: r for e, r in zip(exprs, results) if r} == {}
    series = {**proxy_series(), **connector_series()}
    assert _problems(exprs, series) == []
    # The check's negative controls: an unknown name, and rate() over a gauge.
    assert _problems(["sum(rate(sessionkv_nope_total[1m]))",
                      "rate(sessionkv_proxy_events_applied[1m])",
                      "histogram_quantile(0.5, rate(sessionkv_host_restore_seconds_bucket[1m]))"],
                     series) == [
        "sessionkv_nope_total: not registered (sum(rate(sessionkv_nope_total[1m])))",
        "rate() over the gauge sessionkv_proxy_events_applied "
        "(rate(sessionkv_proxy_events_applied[1m]))"]


def test_every_alert_has_its_runbook_section_and_every_section_an_alert(helm):
    rule = _rules(helm)
    alerts = {a["alert"] for a in _alerts(rule)}
    runbook = OPERATIONS.read_text()
    sections = set(re.findall(r"^### (SessionKV\w+)$", runbook, re.M))
    assert alerts == sections, (sorted(alerts - sections), sorted(sections - alerts))
    for alert in _alerts(rule):
        assert alert["annotations"]["runbook_url"] == (
            f"https://docs.example/vllm-sessionkv/operations#{alert['alert'].lower()}")
        assert alert["annotations"]["summary"]
