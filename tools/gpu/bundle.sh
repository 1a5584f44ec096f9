#!/usr/bin/env bash
# `make gpu-bundle`: everything `make test-gpu` needs on a bare GPU machine, in one directory:
#   bin/lunakv-master bin/lunakv-store   release builds, stripped
#   lunakv-*-abi3-*.whl                   the `mooncake` package (abi3: any CPython >= 3.9)
#   test_gpu.sh test_gpu.py               the check itself
#   compare.sh                            the check three times: defaults, no coalescing,
#                                         no pin-ahead (docs/GPU.md, "The GPU run")
# and refuses a bundle of 64 MiB or more. Copy the directory to the GPU machine and run
# ./test_gpu.sh there. Environment: BUNDLE_DIR (default <target>/gpu-bundle), VENV (where
# maturin is installed; default <repo>/.venv), RDMA=1 (build with the `rdma` cargo feature: the
# RDMA transport, which loads libibverbs at run time and needs cmake + libclang to build,
# docs/RDMA.md).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
target=${CARGO_TARGET_DIR:-$repo/target}
out=${BUNDLE_DIR:-$target/gpu-bundle}
VENV=${VENV:-$repo/.venv}
limit=$((64 << 20))
bin_features=()
wheel_features=()
if [ "${RDMA:-0}" = 1 ]; then
    bin_features=(--features lunakv-store/rdma)
    wheel_features=(--features rdma)
fi

echo "== release binaries"
(cd "$repo" && cargo build --release -p lunakv-master -p lunakv-store --bins ${bin_features[@]+"${bin_features[@]}"})

echo "== release wheel"
if [ ! -x "$VENV/bin/maturin" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q "maturin>=1.9.4,<2"
fi
rm -rf "$target/gpu-wheel"
"$VENV/bin/maturin" build -m "$repo/bindings/python/Cargo.toml" --release --strip \
    -i "$VENV/bin/python" -o "$target/gpu-wheel" ${wheel_features[@]+"${wheel_features[@]}"}

rm -rf "$out"
mkdir -p "$out/bin"
for b in lunakv-master lunakv-store; do
    strip -o "$out/bin/$b" "$target/release/$b"
done
cp "$target"/gpu-wheel/lunakv-*.whl "$out/"
cp "$here/test_gpu.sh" "$here/test_gpu.py" "$here/compare.sh" "$out/"
chmod +x "$out/test_gpu.sh" "$out/test_gpu.py" "$out/compare.sh"

wheel=$(ls "$out"/lunakv-*.whl)
case "$(basename "$wheel")" in
    *-abi3-*) ;;
    *)
        echo "gpu-bundle: $(basename "$wheel") is not an abi3 wheel: check pyo3's abi3-py39 feature in Cargo.toml" >&2
        exit 1
        ;;
esac
size=$(du -sb "$out" | cut -f1)
echo "== bundle $out: $((size >> 20)) MiB ($size bytes)"
ls -l "$out" "$out/bin"
if [ "$size" -ge "$limit" ]; then
    echo "gpu-bundle: $size bytes is over the 64 MiB limit" >&2
    exit 1
fi
