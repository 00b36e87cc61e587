"""Unit tests for ``services/planner/registry.py`` (pure state; the clock is passed in)."""

from __future__ import annotations

import msgpack
import msgspec
import pytest

from services.planner.messages import CLUSTERS, ROLES, RegisterArgs, ReportArgs
from services.planner.registry import RegistrationError, WorkerRegistry


def wire(name: str = "w1", role: object = "prefill", cluster: object = "pd", **extra) -> dict:
    """A ``register`` call's args map, as a worker sends it."""
    d = {"name": name, "role": role, "cluster": cluster, "addr": f"127.0.0.1:{1000 + len(name)}"}
    d.update(extra)
    return d


def info(name: str = "w1", role: str = "prefill", cluster: str = "pd", **extra) -> RegisterArgs:
    """The same, converted as the planner's RPC server converts it."""
    return msgspec.convert(wire(name, role, cluster, **extra), RegisterArgs)


# ---------------------------------------------------------------------------------------- register


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("cluster", CLUSTERS)
def test_register_valid(role, cluster):
    reg = WorkerRegistry()
    rec = reg.register(info("a", role, cluster, kv_addr="h:2", fingerprint={"model_id": "m"}), now=10.0)
    assert (rec.name, rec.role, rec.cluster, rec.kv_addr) == ("a", role, cluster, "h:2")
    assert rec.fingerprint == {"model_id": "m"}
    assert rec.registered_at == rec.last_report == 10.0
    assert reg.workers["a"] is rec


@pytest.mark.parametrize("role", ["", "Prefill", "router", "decoder", None, 1])
def test_register_bad_role(role):
    with pytest.raises(msgspec.ValidationError, match=r"at `\$\.role`"):
        msgspec.convert(wire(role=role), RegisterArgs)


@pytest.mark.parametrize("cluster", ["", None, 7, "a b", "x" * 65, "pd/0"])
def test_register_malformed_cluster_name(cluster):
    with pytest.raises(msgspec.ValidationError, match=r"at `\$\.cluster`"):
        msgspec.convert(wire(cluster=cluster), RegisterArgs)


@pytest.mark.parametrize("cluster", ["PD", "remote", "local"])
async def test_planner_refuses_a_cluster_its_topology_does_not_name(cluster):
    """A well-formed name outside the topology (the default: prfaas and pd) is bad_request at register,
    before the registry sees it."""
    from types import SimpleNamespace

    from common.rpc.errors import RpcError
    from proto.frames import ErrorCode
    from services.planner.server import Planner
    from services.planner.topology import default_topology

    args = msgspec.convert(wire(cluster=cluster), RegisterArgs)  # the message itself is fine
    with pytest.raises(RpcError, match=r"at `\$\.cluster`") as e:
        await Planner.register(SimpleNamespace(topology=default_topology()), args)
    assert e.value.code is ErrorCode.BAD_REQUEST


@pytest.mark.parametrize("field", ["name", "role", "cluster", "addr"])
def test_register_missing_field(field):
    d = wire()
    del d[field]
    with pytest.raises(msgspec.ValidationError, match=f"missing required field `{field}`"):
        msgspec.convert(d, RegisterArgs)


def test_registration_error_is_value_error():
    assert issubclass(RegistrationError, ValueError)


def test_register_optional_fields_default():
    reg = WorkerRegistry()
    rec = reg.register(info("a"), now=1.0)
    assert rec.kv_addr is None
    assert rec.fingerprint == {}
    assert rec.stats == {}


def test_register_replaces_same_name():
    reg = WorkerRegistry(dead_after=3.0)
    reg.register(info("a", "prefill", "pd"), now=0.0)
    reg.register(info("a", "decode", "prfaas"), now=100.0)
    assert len(reg.workers) == 1
    (v,) = reg.view(now=101.0)
    assert v["role"] == "decode" and v["cluster"] == "prfaas"
    assert v["alive"] is True  # re-registration refreshes liveness


def test_register_copies_fingerprint_and_stats():
    fp, stats = {"model_id": "m"}, {"waiting": 1}
    reg = WorkerRegistry()
    rec = reg.register(info("a", fingerprint=fp, stats=stats), now=0.0)
    fp["model_id"] = "changed"
    stats["waiting"] = 99
    assert rec.fingerprint == {"model_id": "m"}
    assert rec.stats == {"waiting": 1}


# ------------------------------------------------------------------------------------------ report


def test_report_unknown_worker():
    reg = WorkerRegistry()
    with pytest.raises(RegistrationError, match="not registered"):
        reg.report("ghost", {"waiting": 0}, now=0.0)
    reg.register(info("a"), now=0.0)
    with pytest.raises(RegistrationError):
        reg.report("b", {"waiting": 0}, now=0.0)


def test_report_non_map_stats():
    with pytest.raises(msgspec.ValidationError, match=r"Expected `object \| null`, got `array` - at `\$\.stats`"):
        msgspec.convert({"name": "a", "stats": [1, 2]}, ReportArgs)
    assert msgspec.convert({"name": "a"}, ReportArgs).stats is None


def test_report_updates_stats_and_time():
    reg = WorkerRegistry(dead_after=3.0)
    reg.register(info("a"), now=0.0)
    reg.report("a", {"waiting": 4, "running": 2, "kv_bytes_inflight": 123}, now=2.5)
    rec = reg.workers["a"]
    assert rec.last_report == 2.5
    assert rec.registered_at == 0.0
    (v,) = reg.view(now=3.0)
    assert v["stats"] == {"waiting": 4, "running": 2, "kv_bytes_inflight": 123}
    assert v["age_s"] == 0.5


# ---------------------------------------------------------------------------------------- liveness


def test_liveness_flips_with_clock():
    reg = WorkerRegistry(dead_after=3.0)
    reg.register(info("a"), now=100.0)
    assert reg.view(100.0)[0]["alive"] is True
    assert reg.view(103.0)[0]["alive"] is True  # exactly dead_after old: still alive
    assert reg.view(103.01)[0]["alive"] is False
    assert reg.view(200.0)[0]["alive"] is False
    # a report brings it back
    reg.report("a", {}, now=200.0)
    assert reg.view(200.0)[0]["alive"] is True
    assert reg.view(202.9)[0]["alive"] is True
    assert reg.view(203.5)[0]["alive"] is False


@pytest.mark.parametrize("dead_after", [0.5, 1.0, 10.0])
def test_liveness_uses_dead_after(dead_after):
    reg = WorkerRegistry(dead_after=dead_after)
    reg.register(info("a"), now=0.0)
    assert reg.view(dead_after * 0.9)[0]["alive"] is True
    assert reg.view(dead_after * 1.1)[0]["alive"] is False


def test_liveness_is_per_worker():
    reg = WorkerRegistry(dead_after=2.0)
    reg.register(info("a"), now=0.0)
    reg.register(info("b", "decode"), now=0.0)
    reg.report("b", {}, now=5.0)
    alive = {v["name"]: v["alive"] for v in reg.view(6.0)}
    assert alive == {"a": False, "b": True}


def test_dead_worker_stays_in_view():
    reg = WorkerRegistry(dead_after=1.0)
    reg.register(info("a"), now=0.0)
    names = [v["name"] for v in reg.view(1000.0)]
    assert names == ["a"]


# -------------------------------------------------------------------------------------------- view


def test_view_sorted_by_name():
    reg = WorkerRegistry()
    for i, n in enumerate(["zeta", "alpha", "mu", "beta", "Alpha"]):
        reg.register(info(n, ROLES[i % 2], CLUSTERS[i % 2]), now=float(i))
    assert [v["name"] for v in reg.view(5.0)] == sorted(["zeta", "alpha", "mu", "beta", "Alpha"])


def test_view_empty():
    assert WorkerRegistry().view(0.0) == []


def test_view_fields():
    reg = WorkerRegistry(dead_after=3.0)
    reg.register(info("a", "decode", "pd", kv_addr="127.0.0.1:9", stats={"running": 1}), now=1.0)
    (v,) = reg.view(2.0)
    assert v == {
        "name": "a", "role": "decode", "cluster": "pd", "addr": wire("a")["addr"], "kv_addr": "127.0.0.1:9",
        "alive": True, "age_s": 1.0, "quarantined": None, "stats": {"running": 1},
    }


def test_view_is_msgpack_safe():
    reg = WorkerRegistry(dead_after=3.0)
    reg.register(info("p", "prefill", "prfaas", kv_addr=None, fingerprint={"model_id": "m", "block_size": 16}), now=0.0)
    reg.register(info("d", "decode", "pd", kv_addr="127.0.0.1:5"), now=0.3)
    reg.report("d", {"waiting": 1, "running": 2, "kv_bytes_inflight": 1 << 40, "util": 0.25}, now=1.1)
    view = reg.view(now=1.234567)
    packed = msgpack.packb(view, use_bin_type=True)
    # strict: only plain msgpack types, no fallback needed, round-trips exactly
    assert msgpack.unpackb(packed, raw=False, strict_map_key=True) == view
    for v in view:
        assert isinstance(v["alive"], bool)
        assert isinstance(v["age_s"], float)
