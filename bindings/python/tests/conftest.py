"""Fixtures that run the real lunakv binaries on loopback for the `mooncake.store` tests.

The binaries come from ``$LUNAKV_BIN_DIR`` (default: ``<repo>/target/debug``); build them first
with ``cargo build --bins`` (``bindings/python/build.sh`` does).
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

# The device test double (docs/GPU.md) for the whole suite: test_device.py hands the module
# CPU-inaccessible "device" buffers; every other test's host buffers must behave exactly as with
# no device layer. Set before the module's first transfer, which is when the layer is chosen.
os.environ.setdefault("LUNAKV_DEVICE", "fake")

REPO = Path(__file__).resolve().parents[3]
BIN_DIR = Path(os.environ.get("LUNAKV_BIN_DIR", REPO / "target" / "debug"))
WORKER = Path(__file__).resolve().parent / "kv_worker.py"

# Mooncake's error codes, as the module returns them.
BUFFER_OVERFLOW = -10
NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704


class Proc:
    """A child binary whose stdout is read line by line in the background."""

    def __init__(self, name: str, args: list[str], env: dict[str, str] | None = None):
        exe = BIN_DIR / name
        if not exe.exists():
            raise RuntimeError(f"{exe} is missing: run `cargo build --bins` first (or set LUNAKV_BIN_DIR)")
        self.name = name
        self.p = subprocess.Popen(
            [str(exe), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.lines.put(line)

    def wait_for(self, word: str, timeout: float = 20.0) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                if self.p.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.p.returncode} before '{word}'")
                continue
            if word in line:
                return dict(t.split("=", 1) for t in line.split() if "=" in t)
        raise RuntimeError(f"{self.name} printed no '{word}' line within {timeout}s")

    def stop(self) -> None:
        """SIGTERM (a graceful stop removes the store's shm socket), SIGKILL after 5 s."""
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.p.kill()
        self.p.wait(timeout=10)


@pytest.fixture
def master_addrs():
    """A lunakv-master on 127.0.0.1 with ephemeral ports; yields ``(rpc, admin)`` addresses
    (admin serves /metrics)."""
    with tempfile.TemporaryDirectory(prefix="lunakv-py-master-") as d:
        p = Proc(
            "lunakv-master",
            ["--rpc_address=127.0.0.1", "--rpc_port=0", "--metrics_port=0", f"--data_dir={d}"],
        )
        try:
            line = p.wait_for("listening")
            yield line["rpc"].strip('",'), line["admin"].strip('",')
        finally:
            p.stop()


@pytest.fixture
def master(master_addrs):
    """A lunakv-master on 127.0.0.1 with ephemeral ports; yields its rpc address."""
    yield master_addrs[0]


def start_store(master_addr: str, size: str, env: dict[str, str] | None = None) -> tuple[Proc, str]:
    """A lunakv-store serving `size` of DRAM; returns it and its segment name."""
    p = Proc(
        "lunakv-store",
        [
            f"--master_server_address={master_addr}",
            "--host=127.0.0.1",
            "--port=0",
            "--metrics_port=0",
            f"--global_segment_size={size}",
        ],
        env,
    )
    return p, p.wait_for("listening")["transfer"].strip('",')


@pytest.fixture
def store_64mb(master):
    p, seg = start_store(master, "64MB")
    try:
        yield seg
    finally:
        p.stop()


def connect(master: str, global_segment_size: int = 0):
    """A set-up MooncakeDistributedStore: embedded with `global_segment_size` > 0, else a pure
    requester."""
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    # vLLM's positional order: local_hostname, metadata_server, global_segment_size,
    # local_buffer_size, protocol, device_name, master_server_address.
    rc = s.setup("127.0.0.1", "P2PHANDSHAKE", global_segment_size, 16 << 20, "tcp", "", master)
    assert rc == 0
    return s


# === a vLLM-like KV cache ===

class KvCache:
    """`layers` x `blocks` blocks of `block_len` bytes, one contiguous region per layer, as
    vLLM's store worker sees a KV cache: a block's object is one piece per layer at
    ``base + layer * layer_stride + block * block_len``."""

    def __init__(self, layers: int, blocks: int, block_len: int):
        self.arr = np.zeros((layers, blocks, block_len), dtype=np.uint8)
        self.layers, self.blocks, self.block_len = layers, blocks, block_len

    @property
    def base(self) -> int:
        return self.arr.ctypes.data

    @property
    def nbytes(self) -> int:
        return self.arr.nbytes

    def pieces(self, block: int) -> tuple[list[int], list[int]]:
        layer_stride = self.blocks * self.block_len
        ptrs = [self.base + layer * layer_stride + block * self.block_len for layer in range(self.layers)]
        return ptrs, [self.block_len] * self.layers

    def addrs(self, blocks: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        ps = [self.pieces(b) for b in blocks]
        return [p for p, _ in ps], [s for _, s in ps]

    def block_bytes(self, block: int) -> bytes:
        return self.arr[:, block, :].tobytes()


def vllm_key(i: int, prefix: str = "t") -> str:
    """A key shaped like vLLM's MooncakeStoreConnector keys."""
    return f"{prefix}@Qwen3-8B@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{i:064x}"


def run_worker(args: list[str], env: dict[str, str] | None = None, timeout: float = 60.0) -> str:
    """Runs tests/kv_worker.py in a fresh Python process; returns its stdout."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    r = subprocess.run(
        [sys.executable, str(WORKER), *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
    )
    assert r.returncode == 0, f"worker failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return r.stdout
