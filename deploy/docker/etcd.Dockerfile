# lunakv/etcd: Debian's etcd-server binary (3.4) and etcdctl on the same base. It serves the
# compose stack (nothing can be pulled here, so quay.io/coreos/etcd is not an option) and runs the
# k8s etcd-tls component's user-setup Job, which needs a shell and etcdctl (the distroless
# quay.io/coreos/etcd 3.5 images have no shell). build-images.sh unpacks the packages with
# `apt-get download` into the build context, so the build needs no network. Where a registry
# exists, any etcd >= 3.4 image serves the etcd itself as well.
FROM debian:bookworm-slim

RUN groupadd --system --gid 10001 etcd \
 && useradd --system --uid 10001 --gid etcd --home-dir /var/lib/etcd --create-home \
        --shell /usr/sbin/nologin etcd

COPY lunakv-probe /usr/local/bin/
COPY etcd etcdctl /usr/local/bin/

USER 10001:10001
WORKDIR /var/lib/etcd
EXPOSE 2379 2380
HEALTHCHECK --interval=5s --timeout=3s --start-period=5s --retries=3 \
    CMD ["lunakv-probe", "http", "2379", "/health", "self"]
ENTRYPOINT ["etcd"]
CMD ["--data-dir=/var/lib/etcd/data", "--listen-client-urls=http://0.0.0.0:2379", "--advertise-client-urls=http://etcd:2379", \
     "--listen-peer-urls=http://0.0.0.0:2380"]
