# lunakv/sidecar: the routing sidecar (llm-d pd-sidecar drop-in, :8000 -> engine :8200; metrics on
# /lunakv/sidecar/metrics). The healthcheck only connects, so it holds with --secure-proxy=true
# too.
# Build context: target/docker-context (deploy/docker/build-images.sh stages it: bin/<release
# binaries>, lunakv-probe, lunakv-entrypoint). Where a registry exists this file builds unchanged
# on the real debian:bookworm-slim; here the base is a debootstrap rootfs imported under that tag.
FROM debian:bookworm-slim

RUN groupadd --system --gid 10001 lunakv \
 && useradd --system --uid 10001 --gid lunakv --home-dir /var/lib/lunakv --create-home \
        --shell /usr/sbin/nologin lunakv

COPY lunakv-probe lunakv-entrypoint /usr/local/bin/
COPY bin/lunakv-sidecar /usr/local/bin/lunakv-sidecar

USER 10001:10001
WORKDIR /var/lib/lunakv
ENV RUST_LOG=info
EXPOSE 8000
HEALTHCHECK --interval=5s --timeout=3s --start-period=10s --retries=3 \
    CMD ["lunakv-probe", "tcp", "8000", "self"]
ENTRYPOINT ["lunakv-entrypoint", "lunakv-sidecar"]
CMD ["--port=8000", "--vllm-port=8200", "--kv-connector=mooncake", "--secure-proxy=false"]
