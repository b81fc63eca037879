# The proxy image: sessionkv-proxy alone, torch-free (the proxy extra: aiohttp, pyzmq,
# redis, msgspec, tokenizers, jinja2; neither torch nor vLLM).  Build from the
# repository:
#   docker build -f deploy/docker/proxy.Dockerfile -t vllm-sessionkv-proxy:0.1.0 .
# tests/deploy/test_images.py checks this file against pyproject.toml.
FROM python:3.11-slim
COPY pyproject.toml README.md LICENSE /src/
COPY vllm_sessionkv /src/vllm_sessionkv
COPY proxy /src/proxy
RUN python3 -m pip install --no-cache-dir "/src[proxy]" && rm -rf /src
USER 65534
EXPOSE 8000
ENTRYPOINT ["sessionkv-proxy"]
