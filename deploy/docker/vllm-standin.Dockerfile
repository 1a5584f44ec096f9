# lunakv/vllm-standin: TEST DOUBLE of vLLM's image (vllm/vllm-openai) for the engine-image test
# (deploy/compose/engine-image.sh): a Python with no `mooncake` package of its own, into which
# lunakv's package arrives only through the lunakv/python init container's volume and PYTHONPATH,
# as in a vLLM pod. Debian's python3 (3.11) on the bookworm base; no vLLM, no torch, no GPU.
# Build context: target/docker-context; debs-python3/ holds python3 and the packages it needs beyond the
# base (build-images.sh downloads them on the host), so the build needs no network.
FROM debian:bookworm-slim

COPY debs-python3/ /tmp/debs/
RUN apt-get install -y -qq --no-install-recommends /tmp/debs/*.deb >/dev/null \
 && rm -rf /tmp/debs /var/cache/apt/archives/*.deb /var/lib/apt/lists/* \
 && python3 -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("mooncake") is not None)'

ENV PYTHONDONTWRITEBYTECODE=1
HEALTHCHECK NONE
CMD ["python3"]
