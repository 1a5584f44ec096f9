# lunakv/python: lunakv's `mooncake` Python package (mooncake.store, mooncake.engine; the abi3
# wheel from bindings/python, unpacked as pip would install it) for engines whose image is not
# rebuilt. Run as an init container: it copies the package into a shared volume (an emptyDir in
# Kubernetes, a named volume in compose) that the engine container mounts at the same path and
# puts on its PYTHONPATH:
#
#   initContainer lunakv/python:dev   -> /opt/lunakv/python (emptyDir)
#   vLLM container: PYTHONPATH=/opt/lunakv/python, the emptyDir mounted read-only
#
# The extension is CPython abi3 (any CPython >= 3.9, vLLM's image runs 3.12) for x86_64 glibc
# Linux; build-images.sh refuses a wheel that needs a newer glibc than vLLM's image has (2.35).
# Build context: target/docker-context (build-images.sh stages python/ from the wheel).
FROM debian:bookworm-slim

RUN groupadd --system --gid 10001 lunakv \
 && useradd --system --uid 10001 --gid lunakv --home-dir /var/lib/lunakv --create-home \
        --shell /usr/sbin/nologin lunakv \
 && mkdir -p /opt/lunakv/python \
 && chown 10001:10001 /opt/lunakv/python

# The installed package (mooncake/ and lunakv-<version>.dist-info/), outside the volume's mount
# point so that mounting the volume does not hide it.
COPY python/ /usr/lib/lunakv/python/
COPY lunakv-python-install /usr/local/bin/

# /opt/lunakv/python exists owned by 10001 so that a fresh named volume mounted there (compose)
# takes that owner; a Kubernetes emptyDir is world-writable.
USER 10001:10001
HEALTHCHECK NONE
ENTRYPOINT ["lunakv-python-install"]
CMD ["/opt/lunakv/python"]
