# lunakv/cli: the operator CLI (status, put, get, exists, rm, bench). Not a service: no
# healthcheck, no ports. In the compose stack: `docker-compose run --rm cli status`.
# Build context: target/docker-context (see build-images.sh).
FROM debian:bookworm-slim

RUN groupadd --system --gid 10001 lunakv \
 && useradd --system --uid 10001 --gid lunakv --home-dir /var/lib/lunakv --create-home \
        --shell /usr/sbin/nologin lunakv

COPY lunakv-probe lunakv-entrypoint /usr/local/bin/
COPY bin/lunakv /usr/local/bin/lunakv

USER 10001:10001
WORKDIR /var/lib/lunakv
HEALTHCHECK NONE
ENTRYPOINT ["lunakv"]
CMD ["--help"]
