# lunakv/etcd: Debian's etcd-server binary (3.4) on the same base, for the compose stack (nothing
# can be pulled here, so quay.io/coreos/etcd is not an option). build-images.sh unpacks the
# package with `apt-get download etcd-server` into the build context, so the build needs no
# network. Where a registry exists, any etcd >= 3.4 image serves as well.
FROM debian:bookworm-slim

RUN groupadd --system --gid 10001 etcd \
 && useradd --system --uid 10001 --gid etcd --home-dir /var/lib/etcd --create-home \
        --shell /usr/sbin/nologin etcd

COPY lunakv-probe /usr/local/bin/
COPY etcd /usr/local/bin/etcd

USER 10001:10001
WORKDIR /var/lib/etcd
EXPOSE 2379 2380
HEALTHCHECK --interval=5s --timeout=3s --start-period=5s --retries=3 \
    CMD ["lunakv-probe", "http", "2379", "/health", "self"]
ENTRYPOINT ["etcd"]
CMD ["--data-dir=/var/lib/etcd/data", "--listen-client-urls=http://0.0.0.0:2379", "--advertise-client-urls=http://etcd:2379", \
     "--listen-peer-urls=http://0.0.0.0:2380"]
