"""`"protocol": "rdma"` (vLLM's and llm-d's default) on a machine without RDMA: setup and
initialize succeed, serve tcp, say why in exactly one WARN line, and report what they serve.

Also `mooncake.allocator`: importing upstream's NVLink/BAREX pool allocators raises an
ImportError that names the alternative (the callers fall back to torch's default pool on it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import start_store

RDMA_WARN = 'protocol "rdma" requested but unavailable'


def run_py(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full = dict(os.environ)
    full.pop("LUNAKV_LOG", None)
    full["RUST_LOG"] = "warn"
    full.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full,
        timeout=60,
    )


def rdma_available() -> bool:
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
    # P/D raw transfers have no RDMA path: the engine always serves tcp; its reason tells
    # whether a device was there at all.
    info = te._protocol_info()
    return "no RDMA path yet" in info["reason"]


@pytest.mark.parametrize("mode", ["embedded", "standalone"])
def test_rdma_setup_without_a_device_serves_tcp_with_one_warning(master, mode):
    if rdma_available():
        pytest.skip("this machine has an RDMA device: rdma is served, nothing falls back")
    store = None
    if mode == "standalone":
        store, _ = start_store(master, "32MB")
    try:
        gss = 16 << 20 if mode == "embedded" else 0
        r = run_py(
            f"""
            import numpy as np
            from mooncake.store import MooncakeDistributedStore
            s = MooncakeDistributedStore()
            # vLLM's positional setup with its default protocol.
            assert s.setup("127.0.0.1", "P2PHANDSHAKE", {gss}, 16 << 20, "rdma", "", "{master}") == 0
            info = s._protocol_info()
            print("INFO", info["requested"], info["effective"], "|", info["display"])
            a = np.arange(4096, dtype=np.uint32).view(np.uint8)
            assert s.register_buffer(a.ctypes.data, a.nbytes) == 0
            assert s.batch_put_from_multi_buffers(["k"], [[a.ctypes.data]], [[a.nbytes]]) == [0]
            b = np.zeros_like(a)
            assert s.register_buffer(b.ctypes.data, b.nbytes) == 0
            assert s.batch_get_into_multi_buffers(["k"], [[b.ctypes.data]], [[b.nbytes]]) == [a.nbytes]
            assert (a == b).all()
            s.close()
            print("OK")
            """
        )
        assert r.returncode == 0, r.stdout + r.stderr
        assert "OK" in r.stdout
        info = next(line for line in r.stdout.splitlines() if line.startswith("INFO"))
        assert info.startswith("INFO rdma tcp | tcp (rdma unavailable: "), info
        warns = [line for line in r.stderr.splitlines() if RDMA_WARN in line]
        assert len(warns) == 1, r.stderr
        assert "WARN" in warns[0] and "serving tcp" in warns[0], warns[0]
    finally:
        if store is not None:
            store.stop()


def test_tcp_setup_says_nothing_about_rdma(master):
    r = run_py(
        f"""
        from mooncake.store import MooncakeDistributedStore
        s = MooncakeDistributedStore()
        assert s.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", "{master}") == 0
        print("INFO", s._protocol_info()["display"])
        s.close()
        """
    )
    assert r.returncode == 0, r.stderr
    assert "INFO tcp" in r.stdout
    assert "rdma" not in r.stderr


def test_transfer_engine_rdma_serves_tcp_with_one_warning():
    r = run_py(
        """
        from mooncake.engine import TransferEngine
        te = TransferEngine()
        assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
        info = te._protocol_info()
        print("INFO", info["requested"], info["effective"], "|", info["display"])
        """
    )
    assert r.returncode == 0, r.stderr
    assert "INFO rdma tcp | tcp (rdma unavailable: " in r.stdout, r.stdout
    warns = [line for line in r.stderr.splitlines() if RDMA_WARN in line]
    assert len(warns) == 1, r.stderr


def test_unknown_protocols_are_still_refused(master):
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "nvlink", "", master) == -600


def test_mooncake_allocator_names_the_alternative():
    import mooncake.allocator as alloc

    assert alloc.AVAILABLE is False
    for name in ("NVLinkAllocator", "BarexAllocator"):
        with pytest.raises(ImportError) as e:
            exec(f"from mooncake.allocator import {name}", {})
        msg = str(e.value)
        assert name in msg and "register_buffer" in msg and "default CUDA memory pool" in msg, msg
    with pytest.raises(AttributeError):
        alloc.no_such_name  # noqa: B018
