#!/usr/bin/env bash
# Builds lunakv's container images on a machine with a Docker engine and no registry.
#
#   deploy/docker/build-images.sh            # cargo build --release, base image if missing, all images
#   SKIP_CARGO=1 deploy/docker/build-images.sh   # reuse target/release binaries
#   deploy/docker/build-images.sh master cli     # only these images
#
# 1. `cargo build --release --bins --features lunakv-store/rdma` on the host (the images only COPY
#    binaries in). The `rdma` feature loads libibverbs at run time (docs/RDMA.md): the store
#    serves "rdma" where the node has an RDMA device, else tcp after one WARN line, and starts
#    where libibverbs is absent. The wheel of lunakv/python is built with it too. LUNAKV_RDMA=0
#    builds both without it.
# 2. The base image `debian:bookworm-slim`: if the engine has no image under that tag (nothing can
#    be pulled here), debootstrap a minimal bookworm rootfs from the Debian mirror apt already uses
#    and `docker import` it under that tag. Skipped when the tag exists, so where a registry exists
#    the real image is used unchanged (pull it first: `docker pull debian:bookworm-slim`).
# 3. A build context under target/docker-context: bin/ (the release binaries, debug info
#    stripped), lunakv-probe (the healthcheck), etcd and etcdctl (Debian's
#    etcd-server and etcd-client binaries: compose's etcd, the k8s etcd user setup),
#    debs-prometheus/ (Debian's prometheus package and what it needs beyond the base, for compose's
#    `observability` profile), debs-rdma/ (libibverbs1, ibverbs-providers, librdmacm1 for
#    lunakv/store: what the rdma transport loads).
# 4. `docker build -f deploy/docker/<name>.Dockerfile -t lunakv/<name>:$TAG target/docker-context`.
#
# Environment: TAG (default dev), LUNAKV_DEBIAN_MIRROR (default: apt's), SKIP_CARGO=1,
# LUNAKV_REBUILD_BASE=1 (re-create the base even if the tag exists), LUNAKV_PROFILE=debug (images from
# target/debug: quicker to iterate, slower to run).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
TAG=${TAG:-dev}
PROFILE=${LUNAKV_PROFILE:-release}
case "$PROFILE" in release) CARGO_PROFILE=(--release) ;; debug) CARGO_PROFILE=() ;;
    *) echo "build-images: LUNAKV_PROFILE must be release or debug" >&2; exit 2 ;; esac
BASE_TAG=debian:bookworm-slim
RDMA_FEATURES=()
WHEEL_FEATURES=()
if [ "${LUNAKV_RDMA:-1}" != 0 ]; then
    RDMA_FEATURES=(--features lunakv-store/rdma)
    WHEEL_FEATURES=(--features rdma)
fi
CTX="$ROOT/target/docker-context"
ALL=(master store bootstrap sidecar engine-sim cli etcd prometheus)
# lunakv/python (the `mooncake` package for engine pods, from the abi3 wheel) and the TEST DOUBLE
# of vLLM's image that the engine-image test runs it in (deploy/compose/engine-image.sh).
ALL+=(python vllm-standin)
IMAGES=("$@")
[ ${#IMAGES[@]} -eq 0 ] && IMAGES=("${ALL[@]}")
want_image() { local i; for i in "${IMAGES[@]}"; do [ "$i" = "$1" ] && return 0; done; return 1; }
export DOCKER_BUILDKIT=${DOCKER_BUILDKIT:-0}

log() { printf '== %s\n' "$*" >&2; }
die() { printf 'build-images: %s\n' "$*" >&2; exit 1; }

command -v docker >/dev/null || die "docker is not installed (apt-get install docker.io)"
docker info >/dev/null 2>&1 || die "the Docker engine is not reachable (is dockerd running? are you in the docker group?)"

# --- 1. binaries -----------------------------------------------------------------------------
if [ "${SKIP_CARGO:-0}" != 1 ]; then
    log "cargo build ${CARGO_PROFILE[*]} --bins ${RDMA_FEATURES[*]}"
    cargo build "${CARGO_PROFILE[@]}" --bins ${RDMA_FEATURES[@]+"${RDMA_FEATURES[@]}"}
fi

# --- 2. base image ---------------------------------------------------------------------------
debian_mirror() {
    if [ -n "${LUNAKV_DEBIAN_MIRROR:-}" ]; then echo "$LUNAKV_DEBIAN_MIRROR"; return; fi
    # The first non-security Debian archive apt is configured with (deb822 or one-line form).
    local m
    m=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list 2>/dev/null \
        | grep -v '^\s*#' | grep -oE 'https?://[^ ]+/debian/?( |$)' | grep -v security | head -n1 | tr -d ' ') || true
    echo "${m:-http://deb.debian.org/debian}"
}

build_base() {
    command -v debootstrap >/dev/null || {
        log "installing debootstrap"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null \
            || die "debootstrap is missing and could not be installed (apt-get install debootstrap)"
    }
    local mirror rootfs
    mirror=$(debian_mirror)
    rootfs=$(mktemp -d "${TMPDIR:-/tmp}/lunakv-rootfs.XXXXXX")
    trap 'rm -rf "$rootfs"' RETURN
    log "debootstrap --variant=minbase bookworm from $mirror (once; cached as $BASE_TAG)"
    debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$rootfs.log" 2>&1 \
        || { tail -n 30 "$rootfs.log" >&2; die "debootstrap failed (log above)"; }
    rm -f "$rootfs.log"
    # Slim it down the way the official -slim image is: no apt caches, docs or man pages.
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
        "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* \
        "$rootfs"/var/log/*.log "$rootfs"/var/cache/debconf/*-old
    printf 'deb %s bookworm main\ndeb %s bookworm-updates main\n' "$mirror" "$mirror" \
        >"$rootfs/etc/apt/sources.list"
    log "docker import -> $BASE_TAG"
    tar --numeric-owner -C "$rootfs" -c . | docker import \
        --change 'CMD ["bash"]' \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'LABEL org.opencontainers.image.description=debootstrap-minbase-bookworm-built-by-lunakv' \
        - "$BASE_TAG" >/dev/null
}

if [ "${LUNAKV_REBUILD_BASE:-0}" = 1 ] || ! docker image inspect "$BASE_TAG" >/dev/null 2>&1; then
    build_base
else
    log "base image $BASE_TAG present (LUNAKV_REBUILD_BASE=1 re-creates it)"
fi

# --- 3. build context ------------------------------------------------------------------------
log "staging the build context in ${CTX#"$ROOT"/}"
rm -rf "$CTX"
mkdir -p "$CTX/bin"
for b in lunakv-master lunakv-store lunakv-bootstrap lunakv-sidecar lunakv-engine-sim lunakv; do
    src="$ROOT/target/$PROFILE/$b"
    [ -x "$src" ] || die "$src is missing: run cargo build ${CARGO_PROFILE[*]} --bins (or drop SKIP_CARGO=1)"
    # Debug info stays on the host (profile.release keeps it for perf); images get the code only.
    objcopy --strip-debug "$src" "$CTX/bin/$b" 2>/dev/null || cp "$src" "$CTX/bin/$b"
done
cp "$ROOT/deploy/docker/lunakv-probe" "$ROOT/deploy/docker/lunakv-entrypoint" "$CTX/"

need_etcd=0
for i in "${IMAGES[@]}"; do [ "$i" = etcd ] && need_etcd=1; done
if [ "$need_etcd" = 1 ]; then
    # Debian's etcd-server and etcd-client packages, unpacked (not installed) on the host
    # through apt: the etcd image then needs no network at build time. Falls back to an
    # installed /usr/bin/etcd and /usr/bin/etcdctl. etcdctl runs the k8s etcd-tls component's
    # user setup (deploy/k8s/components/etcd-tls/etcd-auth.sh).
    for pkg_bin in etcd-server:etcd etcd-client:etcdctl; do
        pkg=${pkg_bin%%:*}; b=${pkg_bin##*:}
        tmp=$(mktemp -d)
        if (cd "$tmp" && apt-get download -qq "$pkg" >/dev/null 2>&1) && dpkg-deb -x "$tmp/${pkg}"_*.deb "$tmp/x"; then
            cp "$tmp/x/usr/bin/$b" "$CTX/$b"
        elif [ -x "/usr/bin/$b" ]; then
            cp "/usr/bin/$b" "$CTX/$b"
        else
            rm -rf "$tmp"; die "no $b binary: apt-get download $pkg failed and /usr/bin/$b is absent"
        fi
        rm -rf "$tmp"
    done
fi

# Debian packages and exactly what they need beyond the base image: apt resolves against the
# base's own dpkg status and downloads on the host, so `docker build` installs them offline
# (dpkg -i) and needs no network, like the etcd image. download_debs DIR PACKAGE...
download_debs() {
    local dir=$1; shift
    log "apt: downloading $* and their dependencies missing from $BASE_TAG"
    local tmp
    tmp=$(mktemp -d)
    mkdir -p "$tmp/archives/partial" "$CTX/$dir"
    docker run --rm --entrypoint cat "$BASE_TAG" /var/lib/dpkg/status >"$tmp/status" \
        || { rm -rf "$tmp"; die "cannot read the dpkg status of $BASE_TAG"; }
    if ! apt-get install -qq --download-only --no-install-recommends \
        -o Debug::NoLocking=1 -o Dir::State::status="$tmp/status" \
        -o Dir::Cache::archives="$tmp/archives" "$@" >"$tmp/apt.log" 2>&1; then
        cat "$tmp/apt.log" >&2; rm -rf "$tmp"
        die "apt-get could not download $* (run apt-get update first?)"
    fi
    # Nothing to download (all in the base already) leaves an empty directory: dpkg is skipped.
    find "$tmp/archives" -maxdepth 1 -name '*.deb' -exec mv {} "$CTX/$dir/" \;
    rm -rf "$tmp"
}

if want_image prometheus; then
    download_debs debs-prometheus prometheus
fi
if want_image store; then
    # What the rdma transport dlopens (libibverbs.so.1, librdmacm.so.1, the mlx5 and other
    # providers). Without them the store still starts and serves tcp.
    download_debs debs-rdma libibverbs1 ibverbs-providers librdmacm1
fi

# --- 3b. lunakv/python: the wheel; lunakv/vllm-standin: Debian's python3 --------------------
# Environment: VENV (a venv with maturin; default <repo>/.venv, created with maturin if absent),
# LUNAKV_ENGINE_GLIBC (default 2.35, vLLM's Ubuntu 22.04 image: the newest glibc the extension
# may need). SKIP_CARGO=1 reuses target/python-wheel.

# The highest GLIBC_x.y symbol version a shared object needs.
glibc_needed() { objdump -T "$1" | grep -oE 'GLIBC_[0-9]+(\.[0-9]+)+' | sed 's/GLIBC_//' | sort -uV | tail -n1; }

if want_image python; then
    # The wheel maturin builds from bindings/python (abi3: one build for every CPython >= 3.9),
    # unpacked into python/ as pip would install it: mooncake/ and lunakv-<v>.dist-info/.
    VENV=${VENV:-$ROOT/.venv}
    WHEEL_DIR="$ROOT/target/python-wheel"
    if [ "${SKIP_CARGO:-0}" = 1 ] && ls "$WHEEL_DIR"/lunakv-*.whl >/dev/null 2>&1; then
        log "reusing $(basename "$(ls "$WHEEL_DIR"/lunakv-*.whl | head -n1)") (SKIP_CARGO=1)"
    else
        if [ ! -x "$VENV/bin/maturin" ]; then
            log "installing maturin into $VENV"
            { [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"; } \
                || die "cannot create $VENV (apt-get install python3-venv, or VENV=<a venv with maturin>)"
            "$VENV/bin/python" -m pip install -q "maturin>=1.9.4,<2" \
                || die "pip install maturin into $VENV failed (VENV=<a venv with maturin>)"
        fi
        case "$PROFILE" in release) wheel_profile=(--release) ;; debug) wheel_profile=(--profile dev) ;; esac
        log "maturin build ${wheel_profile[*]} (bindings/python, the mooncake package)"
        rm -rf "$WHEEL_DIR"
        "$VENV/bin/maturin" build -q -m "$ROOT/bindings/python/Cargo.toml" "${wheel_profile[@]}" --strip \
            ${WHEEL_FEATURES[@]+"${WHEEL_FEATURES[@]}"} \
            -i "$VENV/bin/python" -o "$WHEEL_DIR" >&2 || die "maturin build of bindings/python failed"
    fi
    wheel=$(ls "$WHEEL_DIR"/lunakv-*.whl | head -n1)
    case "$(basename "$wheel")" in
        *-abi3-*) ;;
        *) die "$(basename "$wheel") is not an abi3 wheel: engines run other Pythons (vLLM's image: 3.12); check pyo3's abi3-py39 feature" ;;
    esac
    mkdir -p "$CTX/python"
    "$VENV/bin/python" -m zipfile -e "$wheel" "$CTX/python"
    cp "$ROOT/deploy/docker/lunakv-python-install" "$CTX/"
    # vLLM's image is Ubuntu 22.04 (glibc 2.35): an extension linked against newer symbols
    # would fail there with "version `GLIBC_2.xx' not found" at `import mooncake.store`.
    engine_glibc=${LUNAKV_ENGINE_GLIBC:-2.35}
    so=$(find "$CTX/python/mooncake" -name '_lunakv*.so' | head -n1)
    [ -n "$so" ] || die "$(basename "$wheel") has no mooncake/_lunakv*.so"
    need=$(glibc_needed "$so")
    if [ "$(printf '%s\n%s\n' "$need" "$engine_glibc" | sort -V | tail -n1)" != "$engine_glibc" ]; then
        die "$(basename "$so") needs glibc $need, newer than the engine image's $engine_glibc (LUNAKV_ENGINE_GLIBC): build the wheel on an older glibc (maturin --compatibility manylinux_2_35 in a manylinux container)"
    fi
    log "$(basename "$wheel"): $(basename "$so") needs glibc >= $need (engine image has $engine_glibc)"
fi

if want_image vllm-standin; then
    # Debian's python3 and what it needs beyond the base image, downloaded (not installed) on the
    # host through apt and installed from those files in the image: no network at build time.
    # media-types satisfies python3's "media-types | mime-support"; the other branch pulls perl.
    debs="$ROOT/target/docker-debs/python3"
    mkdir -p "$debs" "$CTX/debs-python3"
    have=$(docker run --rm --entrypoint dpkg-query "$BASE_TAG" -W -f '${Package}\n') \
        || die "cannot list the packages of $BASE_TAG"
    mapfile -t pkgs < <(apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts \
        --no-breaks --no-replaces --no-enhances python3 2>/dev/null | grep -E '^[a-z0-9]' | sort -u \
        | grep -vxE 'mime-support|mailcap|perl|perl-modules-[0-9.]+|libperl[0-9.]+|libgdbm-compat4' \
        | grep -vxF -f <(printf '%s\n' "$have"))
    [ ${#pkgs[@]} -gt 0 ] || die "apt-cache knows no python3 dependencies (run apt-get update)"
    missing=()
    for p in "${pkgs[@]}"; do compgen -G "$debs/${p}_*.deb" >/dev/null || missing+=("$p"); done
    if [ ${#missing[@]} -gt 0 ]; then
        log "apt-get download ${#missing[@]} packages for the python3 stand-in (cached in ${debs#"$ROOT"/})"
        (cd "$debs" && apt-get download -qq -o APT::Sandbox::User=root "${missing[@]}" >/dev/null) \
            || die "apt-get download ${missing[*]} failed (apt-get update first?)"
    fi
    for p in "${pkgs[@]}"; do cp "$debs/${p}"_*.deb "$CTX/debs-python3/"; done
fi

# --- 4. images -------------------------------------------------------------------------------
for i in "${IMAGES[@]}"; do
    df="$ROOT/deploy/docker/$i.Dockerfile"
    [ -f "$df" ] || die "unknown image '$i' (have: ${ALL[*]})"
    log "docker build lunakv/$i:$TAG"
    # stderr only on failure: the legacy builder's deprecation notice is noise here.
    if ! err=$(docker build -q -f "$df" -t "lunakv/$i:$TAG" "$CTX" 2>&1 >/dev/null); then
        printf '%s\n' "$err" >&2
        die "docker build of lunakv/$i:$TAG failed (output above)"
    fi
done
docker images --format '{{.Repository}}:{{.Tag}}  {{.Size}}' | grep -E "^(lunakv/|$BASE_TAG)" >&2
