# lunakv/prometheus: Debian's `prometheus` package (2.42 on bookworm) on the same base as the other
# images, for compose.yaml's `observability` profile (nothing can be pulled here, so
# prom/prometheus is not an option; where a registry exists any Prometheus >= 2.42 image serves
# as well, with deploy/prometheus/prometheus.yml mounted the same way).
# build-images.sh downloads the package and its dependencies on the host (`apt-get download`,
# into debs-prometheus/ of the build context), so `docker build` needs no network. Its scrape config is
# mounted by compose.yaml from deploy/prometheus/prometheus.yml.
FROM debian:bookworm-slim

COPY debs-prometheus/ /tmp/debs/
# The package's maintainer scripts create the `prometheus` user and try to start the service
# (policy-rc.d says no: there is no init in a container). Its web UI (/graph, /targets) uses
# the libjs-* packages it depends on.
RUN printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d \
 && DEBIAN_FRONTEND=noninteractive dpkg -i /tmp/debs/*.deb >/dev/null \
 && rm -rf /tmp/debs /usr/sbin/policy-rc.d /usr/share/doc/* /usr/share/man/* \
 && mkdir -p /prometheus && chown prometheus:prometheus /prometheus

COPY lunakv-probe /usr/local/bin/

USER prometheus
WORKDIR /prometheus
EXPOSE 9090
HEALTHCHECK --interval=2s --timeout=3s --start-period=10s --retries=3 \
    CMD ["lunakv-probe", "http", "9090", "/-/ready"]
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus", \
     "--web.listen-address=:9090", "--web.console.libraries=/etc/prometheus/console_libraries", \
     "--web.console.templates=/etc/prometheus/consoles"]
