"""The Kubernetes manifests (deploy/k8s) against the Kubernetes schemas, offline, with
``kubernetes-validate`` (strict), the Prometheus Operator objects against their schema subset, and
the references between documents; each check is shown to catch a broken manifest."""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is in the test extra: pip install -e '.[test]'")

from common.lab.manifests import K8S_DIR, validate_all  # noqa: E402

EXPECTED_KINDS = {"Namespace", "Secret", "ConfigMap", "Deployment", "StatefulSet", "Service", "PodMonitor", "ServiceMonitor"}


def test_every_manifest_is_valid():
    results = validate_all()
    assert len(results) >= 20
    assert {k.rsplit(":", 1)[1].split("/")[0] for k in results} == EXPECTED_KINDS
    bad = {k: v for k, v in results.items() if v is not None}
    assert not bad, bad


def test_both_datacenters_and_every_service_are_deployed():
    names = {k.rsplit(":", 1)[1] for k in validate_all()}
    assert {"Deployment/gateway", "Deployment/router", "Deployment/planner", "StatefulSet/pd", "StatefulSet/decode",
            "StatefulSet/prefill"} <= names
    text = (K8S_DIR / "prfaas-cluster" / "prefill.yaml").read_text()
    assert "--cluster=prfaas" in text and "namespace: prfaas-remote" in text


def _copy(tmp_path):
    root = tmp_path / "k8s"
    shutil.copytree(K8S_DIR, root)
    return root


def test_an_unknown_field_is_an_error(tmp_path):
    root = _copy(tmp_path)
    f = root / "pd-cluster" / "router.yaml"
    f.write_text(f.read_text().replace("replicas: 1", "replicas: 1\n  replicaz: 2", 1))
    bad = {k: v for k, v in validate_all(root).items() if v}
    assert list(bad) == ["pd-cluster/router.yaml:Deployment/router"], bad
    assert "replicaz" in bad["pd-cluster/router.yaml:Deployment/router"]


def test_a_probe_on_an_undeclared_port_and_a_monitor_typo_are_errors(tmp_path):
    root = _copy(tmp_path)
    f = root / "pd-cluster" / "planner.yaml"
    f.write_text(f.read_text().replace("httpGet: {path: /health, port: metrics}", "httpGet: {path: /health, port: metricz}"))
    m = root / "prfaas-cluster" / "monitoring.yaml"
    m.write_text(m.read_text().replace("podMetricsEndpoints:", "podMetricEndpoints:"))
    bad = {k.rsplit(":", 1)[1]: v for k, v in validate_all(root).items() if v}
    assert set(bad) == {"Deployment/planner", "PodMonitor/prfaas"}, bad
    assert "metricz" in bad["Deployment/planner"]
