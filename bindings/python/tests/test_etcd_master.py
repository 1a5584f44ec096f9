"""An `etcd://` master address: setup_from_env (mooncake_config.json through
ClientOptions::from_mooncake_config) finds the HA master's leader in etcd, as the engines and
the CLI do. Needs Debian's etcd-server; like the Rust suite, a missing etcd fails the test with
what to install unless LUNAKV_ALLOW_SKIP=1 (docs/ARCHITECTURE.md, testing)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request

import pytest
from conftest import Proc

from mooncake.store import MooncakeDistributedStore


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def etcd():
    exe = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
    if exe is None:
        fix = "etcd not found: install Debian's etcd-server (apt-get install -y etcd-server)"
        if os.environ.get("LUNAKV_ALLOW_SKIP") == "1":
            pytest.skip(fix)
        pytest.fail(fix + ", or set LUNAKV_ALLOW_SKIP=1 to skip")
    with tempfile.TemporaryDirectory(prefix="lunakv-py-etcd-") as d:
        client, peer = _free_port(), _free_port()
        c, p = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
        proc = subprocess.Popen(
            [exe, "--name=default", f"--data-dir={d}/data", f"--listen-client-urls={c}",
             f"--advertise-client-urls={c}", f"--listen-peer-urls={p}",
             f"--initial-advertise-peer-urls={p}", f"--initial-cluster=default={p}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    with urllib.request.urlopen(f"{c}/health", timeout=1) as r:
                        if b"true" in r.read():
                            break
                except OSError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("etcd did not become healthy")
                time.sleep(0.1)
            yield f"127.0.0.1:{client}"
        finally:
            proc.kill()
            proc.wait(timeout=10)


def test_setup_from_env_accepts_an_etcd_master_address(etcd, tmp_path, monkeypatch):
    with tempfile.TemporaryDirectory(prefix="lunakv-py-ha-master-") as d:
        master = Proc(
            "lunakv-master",
            ["--rpc_address=127.0.0.1", "--rpc_port=0", "--metrics_port=0", f"--data_dir={d}",
             "--enable_ha", f"--etcd_endpoints={etcd}"],
        )
        try:
            assert master.wait_for("listening", timeout=30).get("ha") == "etcd"
            cfg = tmp_path / "mooncake_config.json"
            cfg.write_text(json.dumps({
                "mode": "embedded",
                "metadata_server": "P2PHANDSHAKE",
                "master_server_address": f"etcd://{etcd}",
                "global_segment_size": "16MB",
                "local_buffer_size": "16MB",
                "protocol": "tcp",
            }))
            monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(cfg))
            s = MooncakeDistributedStore()
            assert s.setup_from_env() == 0
            assert s.put("via-etcd", b"ok") == 0 and s.get("via-etcd") == b"ok"
            s.close()
        finally:
            master.stop()
