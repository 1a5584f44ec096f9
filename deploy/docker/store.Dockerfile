# lunakv/store: the store-client (a DRAM segment, transfer 50052, /metrics 9004). --host must be
# an address peers can dial: $(POD_IP) is expanded by lunakv-entrypoint (or by Kubernetes).
# Build context: target/docker-context (deploy/docker/build-images.sh stages it: bin/<release
# binaries>, lunakv-probe, lunakv-entrypoint, debs-rdma/). Where a registry exists this file builds unchanged
# on the real debian:bookworm-slim; here the base is a debootstrap rootfs imported under that tag.
FROM debian:bookworm-slim

RUN groupadd --system --gid 10001 lunakv \
 && useradd --system --uid 10001 --gid lunakv --home-dir /var/lib/lunakv --create-home \
        --shell /usr/sbin/nologin lunakv

# What the rdma transport loads at run time (libibverbs1, ibverbs-providers, librdmacm1; the
# binary is built with the `rdma` feature): downloaded on the build host into debs-rdma/, so
# this needs no network. A node without an RDMA device serves tcp after one WARN line.
COPY debs-rdma/ /tmp/debs/
RUN if ls /tmp/debs/*.deb >/dev/null 2>&1; then \
        DEBIAN_FRONTEND=noninteractive dpkg -i /tmp/debs/*.deb >/dev/null; fi \
 && rm -rf /tmp/debs /usr/share/doc/* /usr/share/man/*

COPY lunakv-probe lunakv-entrypoint /usr/local/bin/
COPY bin/lunakv-store /usr/local/bin/lunakv-store
# The CLI, for the store-drain component's preStop hook (`lunakv drain` of its own segment).
COPY bin/lunakv /usr/local/bin/lunakv
# The SSD tier's directory (upstream's MOONCAKE_OFFLOAD_FILE_STORAGE_PATH), and the directory of
# the shm socket that same-node engines share (--shm_socket); mount a volume or a hostPath on each.
RUN mkdir -p /data/mooncake-offload /run/lunakv \
 && chown lunakv:lunakv /data/mooncake-offload /run/lunakv
ENV MOONCAKE_OFFLOAD_FILE_STORAGE_PATH=/data/mooncake-offload

USER 10001:10001
WORKDIR /var/lib/lunakv
ENV RUST_LOG=info
EXPOSE 50052 9004
HEALTHCHECK --interval=5s --timeout=3s --start-period=10s --retries=3 \
    CMD ["lunakv-probe", "http", "9004", "/health", "self"]
ENTRYPOINT ["lunakv-entrypoint", "lunakv-store"]
CMD ["--host=$(POD_IP)", "--master_server_address=master:50051", "--global_segment_size=1GB"]
