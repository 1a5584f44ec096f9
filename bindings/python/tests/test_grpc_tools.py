"""Standard gRPC tools work against lunakv's master and bootstrap: server reflection (grpcio's
reflection client, the protocol grpcurl speaks) and grpc.health.v1 (what Kubernetes' `grpc:`
probes call)."""

from __future__ import annotations

import pytest

try:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )
    from google.protobuf.descriptor_pool import DescriptorPool
except ImportError as e:  # pragma: no cover - a setup problem, not a skip
    raise RuntimeError(
        f"{e}: pip install grpcio grpcio-reflection grpcio-health-checking "
        "(bindings/python/build.sh and .ci/run do)"
    ) from e

from conftest import Proc


def reflected(addr: str, service: str) -> tuple[list[str], list[str]]:
    """(services the server lists, methods of `service`) through reflection."""
    with grpc.insecure_channel(addr) as ch:
        db = ProtoReflectionDescriptorDatabase(ch)
        services = list(db.get_services())
        methods = [m.name for m in DescriptorPool(db).FindServiceByName(service).methods]
    return services, methods


def health(addr: str, service: str) -> int:
    with grpc.insecure_channel(addr) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        ).status


def test_master_reflection_and_health(master_addrs):
    rpc, _admin = master_addrs
    services, methods = reflected(rpc, "lunakv.master.v1.Master")
    assert "lunakv.master.v1.Master" in services
    assert "grpc.health.v1.Health" in services
    assert {"MountSegment", "MountInventory", "BatchPutStart", "GetReplicaList"} <= set(methods)
    assert health(rpc, "") == health_pb2.HealthCheckResponse.SERVING
    assert health(rpc, "lunakv.master.v1.Master") == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as e:
        health(rpc, "no.such.Service")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_bootstrap_reflection_and_health():
    p = Proc("lunakv-bootstrap", ["--host=127.0.0.1", "--port=0", "--grpc-port=0"])
    try:
        line = p.wait_for("lunakv-bootstrap listening")
        addr = line["grpc"].strip('",')
        services, methods = reflected(addr, "lunakv.bootstrap.v1.Bootstrap")
        assert "lunakv.bootstrap.v1.Bootstrap" in services and methods
        assert health(addr, "") == health_pb2.HealthCheckResponse.SERVING
        assert health(addr, "lunakv.bootstrap.v1.Bootstrap") == health_pb2.HealthCheckResponse.SERVING
    finally:
        p.stop()
