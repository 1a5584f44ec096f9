# lunakv/engine-sim: TEST DOUBLE of a vLLM engine (OpenAI API + MooncakeConnector P/D flow) for
# the compose stack and tests. Not an inference engine.
# Build context: target/docker-context (deploy/docker/build-images.sh stages it: bin/<release
# binaries>, lunakv-probe, lunakv-entrypoint). Where a registry exists this file builds unchanged
# on the real debian:bookworm-slim; here the base is a debootstrap rootfs imported under that tag.
FROM debian:bookworm-slim

RUN groupadd --system --gid 10001 lunakv \
 && useradd --system --uid 10001 --gid lunakv --home-dir /var/lib/lunakv --create-home \
        --shell /usr/sbin/nologin lunakv

COPY lunakv-probe lunakv-entrypoint /usr/local/bin/
COPY bin/lunakv-engine-sim /usr/local/bin/lunakv-engine-sim

USER 10001:10001
WORKDIR /var/lib/lunakv
ENV RUST_LOG=info
EXPOSE 8200
HEALTHCHECK --interval=5s --timeout=3s --start-period=10s --retries=3 \
    CMD ["lunakv-probe", "http", "8200", "/health", "self"]
ENTRYPOINT ["lunakv-entrypoint", "lunakv-engine-sim"]
CMD ["--host=$(POD_IP)", "--port=8200", "--role=both"]
