# lunakv/master: the pool master (gRPC 50051, admin + /metrics 9003). HA: add --enable_ha
# --etcd_endpoints=... --advertise_address=$(POD_IP).
# Build context: target/docker-context (deploy/docker/build-images.sh stages it: bin/<release
# binaries>, lunakv-probe, lunakv-entrypoint). Where a registry exists this file builds unchanged
# on the real debian:bookworm-slim; here the base is a debootstrap rootfs imported under that tag.
FROM debian:bookworm-slim

RUN groupadd --system --gid 10001 lunakv \
 && useradd --system --uid 10001 --gid lunakv --home-dir /var/lib/lunakv --create-home \
        --shell /usr/sbin/nologin lunakv

COPY lunakv-probe lunakv-entrypoint /usr/local/bin/
COPY bin/lunakv-master /usr/local/bin/lunakv-master

USER 10001:10001
WORKDIR /var/lib/lunakv
ENV RUST_LOG=info
EXPOSE 50051 9003
HEALTHCHECK --interval=5s --timeout=3s --start-period=10s --retries=3 \
    CMD ["lunakv-probe", "http", "9003", "/health", "self"]
ENTRYPOINT ["lunakv-entrypoint", "lunakv-master"]
CMD ["--rpc_address=0.0.0.0", "--data_dir=/var/lib/lunakv/master"]
