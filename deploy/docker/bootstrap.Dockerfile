# lunakv/bootstrap: the P/D bootstrap (vLLM /register + /query on HTTP 8998, gRPC 8999). Runs next
# to the prefill engine: the sidecar queries <prefill-host>:8998.
# Build context: target/docker-context (deploy/docker/build-images.sh stages it: bin/<release
# binaries>, lunakv-probe, lunakv-entrypoint). Where a registry exists this file builds unchanged
# on the real debian:bookworm-slim; here the base is a debootstrap rootfs imported under that tag.
FROM debian:bookworm-slim

RUN groupadd --system --gid 10001 lunakv \
 && useradd --system --uid 10001 --gid lunakv --home-dir /var/lib/lunakv --create-home \
        --shell /usr/sbin/nologin lunakv

COPY lunakv-probe lunakv-entrypoint /usr/local/bin/
COPY bin/lunakv-bootstrap /usr/local/bin/lunakv-bootstrap

USER 10001:10001
WORKDIR /var/lib/lunakv
ENV RUST_LOG=info
EXPOSE 8998 8999
HEALTHCHECK --interval=5s --timeout=3s --start-period=10s --retries=3 \
    CMD ["lunakv-probe", "http", "8998", "/health", "self"]
ENTRYPOINT ["lunakv-entrypoint", "lunakv-bootstrap"]
CMD ["--host=0.0.0.0"]
