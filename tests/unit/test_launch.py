"""The engine command line the launcher builds (no engine started)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from vllm_sessionkv.dev.launch import (
    LOCAL_HOST,
    ClusterSpec,
    EngineSpec,
    Host,
    LocalCluster,
    default_dtype,
    engine_command,
    parse_placement,
)


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_cpu_engine_gets_a_fractional_kv_cache_and_a_loadable_compile_cache(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")  # would override the flag in vLLM
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    argv, env = engine_command(EngineSpec(role="decode", model="m", port=1,
                                          kv_cache_space_gb=0.25))
    assert _flag(argv, "--kv-cache-memory-bytes") == str(2**28)
    assert "VLLM_CPU_KVCACHE_SPACE" not in env
    assert env["VLLM_USE_AOT_COMPILE"] == "0"


def test_operator_compile_setting_is_kept(monkeypatch):
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    _, env = engine_command(EngineSpec(role="prefill", model="m", port=1))
    assert env["VLLM_USE_AOT_COMPILE"] == "1"


def test_gpu_engine_keeps_vllms_kv_cache_sizing(monkeypatch):
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    argv, env = engine_command(EngineSpec(role="decode", model="m", port=1, gpus="0"))
    assert _flag(argv, "--kv-cache-memory-bytes") is None
    assert env["CUDA_VISIBLE_DEVICES"] == "0"
    assert "VLLM_USE_AOT_COMPILE" not in env


def test_an_engine_on_another_host_listens_and_is_reached_there():
    host = Host(address="10.213.7.2", command_prefix=["ip", "netns", "exec", "p"],
                env={"UCX_TLS": "tcp", "UCX_NET_DEVICES": "vp1"})
    spec = EngineSpec(role="decode", model="m", port=8000, side_channel_port=5600,
                      kv_events_port=5601, sessionkv={"early_decode_port": 5602}, host=host)
    argv, env = engine_command(spec)
    assert argv[:4] == ["ip", "netns", "exec", "p"]
    assert _flag(argv, "--host") == "10.213.7.2"
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.213.7.2"
    assert env["VLLM_HOST_IP"] == "10.213.7.2"
    assert env["UCX_TLS"] == "tcp" and env["UCX_NET_DEVICES"] == "vp1"
    assert spec.url == "http://10.213.7.2:8000"
    assert spec.kv_events_endpoint == "tcp://10.213.7.2:5601"
    assert spec.early_decode_endpoint == "tcp://10.213.7.2:5602"


def test_a_local_engine_keeps_ucx_on_loopback():
    spec = EngineSpec(role="prefill", model="m", port=8000)
    argv, env = engine_command(spec)
    assert argv[0] == sys.executable and _flag(argv, "--host") == "127.0.0.1"
    assert env["UCX_NET_DEVICES"] == "lo" and env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert spec.url == "http://127.0.0.1:8000"
    assert Host(address="::1").endpoint(80) == "[::1]:80"


@pytest.mark.parametrize("raw,named", [
    ({"decode0": {"address": "dhost"}}, "placement.decode0"),
    ({"decode0": {"address": "0.0.0.0"}}, "placement.decode0"),
    ({"proxy": {"adress": "10.0.0.1"}}, "placement.proxy"),
    ({"redis": {"command_prefix": "ip netns exec x"}}, "placement.redis"),
    (["decode0"], "placement"),
])
def test_a_bad_placement_is_refused_naming_the_entry(raw, named):
    with pytest.raises(ValueError, match=named):
        parse_placement(raw)


def test_a_placement_must_name_a_process_of_the_cluster():
    placement = parse_placement({"decode1": {"address": "10.0.0.3"}})
    with pytest.raises(ValueError, match="decode1"):
        ClusterSpec(model="m", placement=placement)
    spec = ClusterSpec(model="m", decode=2, placement=placement)
    assert spec.host("decode1").address == "10.0.0.3"
    assert spec.host("decode0") == LOCAL_HOST


def _kv_bytes(engine: EngineSpec) -> int:
    return int(_flag(engine_command(engine)[0], "--kv-cache-memory-bytes"))


def test_decode_engines_can_get_their_own_kv_cache():
    cluster = LocalCluster(ClusterSpec(model="m", prefill=1, decode=2, colocated=True,
                                       kv_cache_space_gb=0.25, decode_kv_cache_space_gb=0.02))
    assert _kv_bytes(cluster._engine("prefill", 0, "prefill0")) == 2**28
    for i in range(2):
        assert _kv_bytes(cluster._engine("decode", 1 + i, f"decode{i}")) == int(0.02 * 2**30)
    # The co-located reference keeps the cluster's default, like P.
    assert _kv_bytes(cluster._colocated_engine()) == 2**28
    same = LocalCluster(ClusterSpec(model="m", kv_cache_space_gb=0.25))
    assert _kv_bytes(same._engine("decode", 1, "decode0")) == 2**28


def test_a_cluster_is_started_once_by_with_cluster_start(monkeypatch, tmp_path):
    """``with cluster.start():`` once started every engine twice (__enter__ started the
    cluster again): small_kv_cluster ran six engines, each start twice as long."""
    import vllm_sessionkv.dev.launch as launch

    spawned = []

    class FakeProcess:
        name = "redis"

        def alive(self):
            return True

    def fake_redis(*_args, **_kwargs):
        spawned.append("redis")
        return FakeProcess()

    monkeypatch.setattr(launch, "start_redis", fake_redis)
    monkeypatch.setattr(launch, "wait_redis", lambda *a, **k: None)
    monkeypatch.setattr(launch, "stop_all", lambda procs, **k: None)
    cluster = LocalCluster(ClusterSpec(model="m", prefill=0, decode=0, redis=True,
                                       proxy=False, log_dir=tmp_path))
    with cluster.start() as same:
        assert same is cluster
    assert spawned == ["redis"]
    cluster = LocalCluster(ClusterSpec(model="m", prefill=0, decode=0, redis=True,
                                       proxy=False, log_dir=tmp_path))
    cluster.start()
    with pytest.raises(RuntimeError, match="already started"):
        cluster.start()


def _local_cluster_main():
    path = Path(__file__).resolve().parents[2] / "examples" / "local_cluster.py"
    module_spec = importlib.util.spec_from_file_location("local_cluster_cli", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def _cli_without_start(monkeypatch, tmp_path):
    """local_cluster.py with LocalCluster replaced by a recorder: (module, the
    ClusterSpecs main() built, newest last).  main() then returns 1 at start."""
    cli = _local_cluster_main()
    specs = []

    class NoStart:
        def __init__(self, spec):
            specs.append(spec)

        def start(self):
            raise RuntimeError("not started in a unit test")

    monkeypatch.setattr(cli, "LocalCluster", NoStart)
    # main() would leave a work folder behind and replace pytest's signal handlers.
    monkeypatch.setattr(cli.signal, "signal", lambda *_: None)
    monkeypatch.setattr(cli.tempfile, "mkdtemp", lambda **_: str(tmp_path))
    return cli, specs


def test_local_cluster_passes_decode_kv_cache_gb_to_the_spec(monkeypatch, tmp_path):
    cli, seen = _cli_without_start(monkeypatch, tmp_path)
    common = ["--model", str(tmp_path), "--log-dir", str(tmp_path / "logs"),
              "--kv-cache-gb", "0.25"]
    assert cli.main([*common, "--decode-kv-cache-gb", "0.02"]) == 1
    assert seen[-1].kv_cache_space_gb == 0.25
    assert seen[-1].decode_kv_cache_space_gb == 0.02
    assert cli.main(common) == 1
    assert seen[-1].decode_kv_cache_space_gb is None
    with pytest.raises(SystemExit):
        cli.main([*common, "--decode-kv-cache-gb", "0"])


def test_an_engine_serves_the_model_under_its_served_name():
    argv, _ = engine_command(EngineSpec(role="decode", model="/tmp/w/sessionkv-tiny-model",
                                        port=1, served_model_name="sessionkv-tiny-model"))
    assert _flag(argv, "--model") == "/tmp/w/sessionkv-tiny-model"
    assert _flag(argv, "--served-model-name") == "sessionkv-tiny-model"
    argv, _ = engine_command(EngineSpec(role="decode", model="m", port=1))
    assert "--served-model-name" not in argv   # vLLM's default: the --model value


def test_every_engine_of_a_cluster_serves_the_clusters_model_name():
    cluster = LocalCluster(ClusterSpec(model="/tmp/w/m", served_model_name="n", decode=2,
                                       colocated=True))
    for role, index, name in (("prefill", 0, "prefill0"), ("decode", 1, "decode0"),
                              ("decode", 2, "decode1")):
        argv, _ = engine_command(cluster._engine(role, index, name))
        assert _flag(argv, "--served-model-name") == "n", name
    # The co-located baseline too: a client sends it the name it sends the proxy.
    assert _flag(engine_command(cluster._colocated_engine())[0], "--served-model-name") == "n"
    plain = LocalCluster(ClusterSpec(model="/tmp/w/m"))
    assert "--served-model-name" not in engine_command(plain._engine("decode", 1, "d"))[0]


def test_the_generated_model_is_served_under_a_stable_name(monkeypatch, tmp_path):
    """Its folder is temporary; requests and /v1/models name it sessionkv-tiny-model.
    A model the operator names keeps vLLM's default unless --served-model-name."""
    cli, specs = _cli_without_start(monkeypatch, tmp_path)
    generated = []

    def generate(path, **_):
        generated.append(path)
        return path

    monkeypatch.setattr("vllm_sessionkv.dev.tiny_model.generate_tiny_model", generate)
    logs = ["--log-dir", str(tmp_path / "logs")]
    assert cli.main(logs) == 1
    assert generated[-1].name == "sessionkv-tiny-model"
    assert (specs[-1].model, specs[-1].served_model_name) == \
        (str(generated[-1]), "sessionkv-tiny-model")
    assert cli.main([*logs, "--served-model-name", "tiny"]) == 1
    assert specs[-1].served_model_name == "tiny"
    assert cli.main([*logs, "--model", str(tmp_path)]) == 1
    assert (specs[-1].model, specs[-1].served_model_name) == (str(tmp_path), None)
    assert cli.main([*logs, "--model", str(tmp_path), "--served-model-name", "mine"]) == 1
    assert specs[-1].served_model_name == "mine"
    assert len(generated) == 2


def test_every_engine_of_a_cluster_runs_the_clusters_dtype(monkeypatch, tmp_path):
    """The CPU's default unless asked; --dtype reaches P, D and the co-located baseline
    alike."""
    assert _flag(engine_command(EngineSpec(role="decode", model="m", port=1))[0],
                 "--dtype") == default_dtype(gpus=False)
    assert _flag(engine_command(EngineSpec(role="decode", model="m", port=1, gpus="0"))[0],
                 "--dtype") == "bfloat16"
    cluster = LocalCluster(ClusterSpec(model="m", decode=2, colocated=True, dtype="float32"))
    for role, index, name in (("prefill", 0, "prefill0"), ("decode", 1, "decode0"),
                              ("decode", 2, "decode1")):
        assert _flag(engine_command(cluster._engine(role, index, name))[0], "--dtype") == \
            "float32", name
    assert _flag(engine_command(cluster._colocated_engine())[0], "--dtype") == "float32"
    cli, specs = _cli_without_start(monkeypatch, tmp_path)

    common = ["--model", str(tmp_path), "--log-dir", str(tmp_path / "logs")]
    assert cli.main(common) == 1
    assert specs[-1].dtype is None
    assert cli.main([*common, "--dtype", "float32"]) == 1
    assert specs[-1].dtype == "float32"
    with pytest.raises(SystemExit):
        cli.main([*common, "--dtype", "fp32"])


def test_local_cluster_can_start_every_engine_eager(monkeypatch, tmp_path):
    cli, specs = _cli_without_start(monkeypatch, tmp_path)

    common = ["--model", str(tmp_path), "--log-dir", str(tmp_path / "logs")]
    assert cli.main(common) == 1
    assert specs[-1].engine_extra_args == []
    assert cli.main([*common, "--enforce-eager"]) == 1
    cluster = LocalCluster(specs[-1])
    for engine in (cluster._engine("prefill", 0, "prefill0"), cluster._colocated_engine()):
        assert "--enforce-eager" in engine_command(engine)[0]


def test_each_engine_gets_a_core_of_its_own_while_there_are_enough():
    from vllm_sessionkv.dev.cores import plan_cores

    plan = plan_cores(["prefill0", "decode0"], [0, 1, 2])
    assert plan.binds == {"prefill0": "0", "decode0": "1"}
    assert plan.env("decode0") == {"VLLM_CPU_OMP_THREADS_BIND": "1"}
    assert "one core per engine" in plan.rule


def test_more_engines_than_cores_go_round_robin_and_the_rule_says_so():
    from vllm_sessionkv.dev.cores import plan_cores

    names = ["prefill0", "prefill1", "decode0", "decode1", "colocated"]
    plan = plan_cores(names, [1, 0])
    assert plan.binds == {"prefill0": "0", "prefill1": "1", "decode0": "0",
                          "decode1": "1", "colocated": "0"}
    assert "5 engines on 2 cores, round robin" in plan.rule
    assert "colocated->0" in plan.rule


@pytest.mark.parametrize("kwargs, why", [({"mode": "vllm"}, "asked for"),
                                         ({"gpus": True}, "GPU host"),
                                         ({"stock_nixl": True}, "stock NixlConnector")])
def test_gpu_hosts_stock_nixl_and_vllm_mode_keep_vllms_binding(kwargs, why):
    from vllm_sessionkv.dev.cores import plan_cores

    plan = plan_cores(["prefill0", "decode0"], [0, 1], **kwargs)
    assert plan.binds == {"prefill0": None, "decode0": None}
    assert plan.env("prefill0") == {}
    assert why in plan.rule


def test_explicit_cores_need_one_value_per_engine():
    from vllm_sessionkv.dev.cores import plan_cores

    assert plan_cores(["prefill0", "decode0"], [0, 1], "1, 0-1").binds == \
        {"prefill0": "1", "decode0": "0-1"}
    with pytest.raises(ValueError, match="2 engines .* need 2"):
        plan_cores(["prefill0", "decode0"], [0, 1], "0")
    with pytest.raises(ValueError, match="cores"):
        ClusterSpec(model="m", cores="0,1,0")


def test_the_cluster_binds_each_engine_to_its_planned_core(monkeypatch):
    """The plan reaches every engine's environment, the co-located one's too, and the
    engine command keeps it (it is applied after the host's environment)."""
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {0, 1}, raising=False)
    spec = ClusterSpec(model="m", prefill=1, decode=1, colocated=True)
    cluster = LocalCluster(spec)
    assert cluster.core_plan.binds == {"prefill0": "0", "decode0": "1", "colocated": "0"}
    engine = cluster._engine("decode", 1, "decode0")
    engine.extra_env.update(cluster.core_plan.env("decode0"))
    assert engine_command(engine)[1]["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    gpu = LocalCluster(ClusterSpec(model="m", gpus=["0", "1"]))
    assert set(gpu.core_plan.binds.values()) == {None}


def test_local_cluster_prints_the_core_rule_before_it_starts(monkeypatch, tmp_path, capsys):
    cli, _ = _cli_without_start(monkeypatch, tmp_path)
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {0, 1}, raising=False)
    common = ["--model", str(tmp_path), "--log-dir", str(tmp_path / "logs"),
              "--colocated-port", "22990"]
    assert cli.main(common) == 1
    assert "cores: 3 engines on 2 cores, round robin" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main([*common, "--cores", "0"])


def test_kv_event_sockets_bind_the_engines_address_only():
    """vLLM 0.32 binds the PUB endpoint only when it holds ``*`` or ``::``; the
    IPv4-mapped form does, and ZMQ binds it as the IPv4 address alone: a connection
    to another loopback address is refused (control: ``*`` takes it)."""
    import json

    import zmq
    from helpers import connection_refused as refused
    from vllm.distributed.kv_events import ZmqEventPublisher

    from vllm_sessionkv.dev.launch import kv_events_bind

    spec = EngineSpec(role="decode", model="m", port=8000, kv_events_port=5601,
                      kv_events_replay_port=5603, host=Host(address="10.213.7.2"))
    events = json.loads(_flag(engine_command(spec)[0], "--kv-events-config"))
    assert events["endpoint"] == "tcp://[::ffff:10.213.7.2]:5601"
    assert events["replay_endpoint"] == "tcp://10.213.7.2:5603"
    assert ZmqEventPublisher._is_bind_endpoint(events["endpoint"])
    assert kv_events_bind("fd00::2", 5601) == "tcp://*:5601"   # IPv6: ZMQ needs IPV6

    context = zmq.Context()
    try:
        for endpoint, open_elsewhere in ((kv_events_bind("127.0.0.1", 0), False),
                                         ("tcp://*:0", True)):
            pub = context.socket(zmq.PUB)
            pub.setsockopt(zmq.LINGER, 0)
            pub.bind(endpoint.replace(":0", ":*") if endpoint.endswith(":0") else endpoint)
            port = int(pub.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
            assert not refused("127.0.0.1", port)
            assert refused("127.0.0.2", port) is not open_elsewhere, endpoint
            pub.close()
    finally:
        context.term()


def test_cluster_secrets_reach_engines_and_proxy_by_environment():
    from vllm_sessionkv.dev.launch import ClusterSpec, LocalCluster

    cluster = LocalCluster(ClusterSpec(model="m", engine_api_key="ek", api_key="ck",
                                       side_port_secret="s" * 16, base_port=9000))
    decode = cluster._engine("decode", 1, "decode0")
    argv, env = engine_command(decode)
    assert _flag(argv, "--api-key") == "ek"
    assert env["SESSIONKV_SIDE_PORT_SECRET"] == "s" * 16
    assert cluster._proxy_secrets() == {"SESSIONKV_ENGINE_API_KEY": "ek",
                                        "SESSIONKV_PROXY_API_KEY": "ck",
                                        "SESSIONKV_SIDE_PORT_SECRET": "s" * 16}
    assert LocalCluster(ClusterSpec(model="m"))._proxy_secrets() == {}


@pytest.mark.parametrize(("flags", "expected"), [
    ("fpu sse avx2 fma", "float32"),                       # AVX2 only: software bf16
    ("fpu avx2 avx512f avx512_bf16", "bfloat16"),
    ("fpu avx2 avx512f amx_bf16 amx_tile", "bfloat16"),
    ("fp asimd bf16 i8mm", "bfloat16"),                    # aarch64
])
def test_the_default_dtype_is_bfloat16_only_where_the_cpu_computes_it(
        monkeypatch, flags, expected):
    real_read = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: (
        f"processor : 0\nflags : {flags}\n" if str(self) == "/proc/cpuinfo"
        else real_read(self, *a, **k)))
    assert default_dtype(gpus=False) == expected
    assert default_dtype(gpus=True) == "bfloat16"
