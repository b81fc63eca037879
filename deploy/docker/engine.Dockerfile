# The engine image: vLLM's own release image, plus this package with its gpu extra
# (the connector; the extra's vllm pin is already met by the base image, so pip adds
# only nixl, redis and prometheus-client as pinned there).  Build from the repository:
#   docker build -f deploy/docker/engine.Dockerfile -t vllm-sessionkv:0.1.0 .
# The chart runs `python3 -m vllm.entrypoints.openai.api_server` in it; vLLM loads
# the connector through kv_connector_module_path (and the vllm.general_plugins entry
# point).  tests/deploy/test_images.py checks this file against pyproject.toml.
FROM vllm/vllm-openai:v0.32.0
COPY pyproject.toml README.md LICENSE /src/
COPY vllm_sessionkv /src/vllm_sessionkv
COPY proxy /src/proxy
RUN python3 -m pip install --no-cache-dir "/src[gpu]" && rm -rf /src
