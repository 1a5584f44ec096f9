"""The pool token from an engine's point of view (docs/SECURITY.md): vLLM's calls are
unchanged; the token comes from LUNAKV_AUTH_TOKEN in the engine's environment. Without it, a
master that requires one refuses the engine's calls with an error code, and nothing is read.
With the token every owner requires capabilities on its transfer port (docs/SECURITY.md,
"Capabilities"); the engine's puts and gets carry the master's, with no change to vLLM."""

import tempfile

from conftest import Proc, connect, start_store

TOKEN = "engine-token-0123456789abcdef"


def test_engine_presents_the_pool_token_from_its_environment(monkeypatch):
    env = {"LUNAKV_AUTH_TOKEN": TOKEN}
    with tempfile.TemporaryDirectory(prefix="lunakv-py-auth-") as d:
        m = Proc(
            "lunakv-master",
            ["--rpc_address=127.0.0.1", "--rpc_port=0", "--metrics_port=0", f"--data_dir={d}"],
            env,
        )
        try:
            addr = m.wait_for("listening")["rpc"].strip('",')
            store, _ = start_store(addr, "64MB", env)
            try:
                monkeypatch.delenv("LUNAKV_AUTH_TOKEN", raising=False)
                stranger = connect_or_none(addr)
                if stranger is not None:
                    assert stranger.put("py-guarded", b"x" * 4096) != 0
                    stranger.close()

                monkeypatch.setenv("LUNAKV_AUTH_TOKEN", TOKEN)
                s = connect(addr)
                value = bytes(range(256)) * 16
                assert s.put("py-guarded", value) == 0
                assert s.get("py-guarded") == value
                # An embedded engine (its own segment, which then requires capabilities too)
                # and the requester read each other's objects with the master's capabilities.
                e = connect(addr, 32 << 20)
                other = bytes(reversed(range(256))) * 64
                for i in range(8):
                    assert e.put(f"py-caps-{i}", other) == 0
                for i in range(8):
                    assert s.get(f"py-caps-{i}") == other
                    assert e.get(f"py-caps-{i}") == other
                assert e.get("py-guarded") == value
                e.close()
                s.close()

                monkeypatch.delenv("LUNAKV_AUTH_TOKEN")
                again = connect_or_none(addr)
                if again is not None:
                    assert again.get("py-guarded") == b"", "read without the token"
                    again.close()
            finally:
                store.stop()
        finally:
            m.stop()


def connect_or_none(addr: str):
    """A requester, or None when setup itself is refused (rc != 0)."""
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", addr)
    return s if rc == 0 else None
