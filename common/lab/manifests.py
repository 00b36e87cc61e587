"""Offline validation of the Kubernetes manifests under ``deploy/k8s`` (no cluster, no network).

Rendering: each ``deploy/k8s/*/kustomization.yaml`` lists its resource files (plain YAML, no
patches), each of which may hold several documents; the kustomization's ``namespace`` must match
every document's. Each document is then checked:

- a built-in kind against the Kubernetes OpenAPI schemas that the ``kubernetes-validate`` package
  ships (strict: unknown fields are errors), at :data:`K8S_VERSION`;
- a Prometheus Operator kind (``PodMonitor``, ``ServiceMonitor``) against
  ``deploy/k8s/schemas/monitoring.coreos.com-v1.json`` (kubernetes-validate has no schemas for
  custom resources);
- and across documents: every ConfigMap and Secret a container reads exists in its namespace, and
  every probe and Service port names a container port.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from common.lab.procs import ROOT

K8S_DIR = ROOT / "deploy" / "k8s"
K8S_VERSION = "1.37.0"
MONITORING = ("PodMonitor", "ServiceMonitor")


def render(kustomization: Path, root: Path = K8S_DIR) -> list[tuple[str, dict[str, Any]]]:
    """``(file relative to root, document)`` for every document of every resource ``kustomization`` lists. Raises
    ``ValueError`` for a missing file or a document outside the kustomization's namespace."""
    import yaml

    spec = yaml.safe_load(kustomization.read_text())
    out = []
    for name in spec.get("resources", []):
        path = kustomization.parent / name
        if not path.is_file():
            raise ValueError(f"{kustomization}: resource {name} does not exist")
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is None:
                continue
            ns = doc.get("metadata", {}).get("namespace", spec.get("namespace") if doc.get("kind") != "Namespace" else None)
            if doc.get("kind") != "Namespace" and ns != spec.get("namespace"):
                raise ValueError(f"{path}: {doc.get('kind')}/{doc['metadata'].get('name')} is in namespace {ns}, "
                                 f"not the kustomization's {spec.get('namespace')}")
            out.append((str(path.relative_to(root)), doc))
    return out


def _schema_error(doc: dict[str, Any]) -> str | None:
    """The first schema violation of one document, or None."""
    import jsonschema
    import kubernetes_validate

    kind = doc.get("kind")
    if kind in MONITORING:
        schemas = json.loads((K8S_DIR / "schemas" / "monitoring.coreos.com-v1.json").read_text())
        schema = {**schemas[kind], "$defs": schemas["$defs"]}
        err = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(doc))
        return None if err is None else f"{'.'.join(map(str, err.path))}: {err.message}"
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return f"{'.'.join(map(str, e.path))}: {e.message}"
    except kubernetes_validate.SchemaNotFoundError as e:
        return f"no schema: {e}"
    return None


def _pod_spec(doc: dict[str, Any]) -> dict[str, Any] | None:
    return ((doc.get("spec") or {}).get("template") or {}).get("spec") if doc.get("kind") in ("Deployment", "StatefulSet") else None


def cross_errors(docs: list[tuple[str, dict[str, Any]]]) -> dict[str, str]:
    """References between documents that do not resolve, by document key (see the module docstring)."""
    have = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for _, d in docs}
    errors: dict[str, str] = {}
    pods_ports: dict[tuple[str, str], set[str]] = {}  # (namespace, app name) -> container port names
    for f, d in docs:
        spec = _pod_spec(d)
        if spec is None:
            continue
        ns = d["metadata"].get("namespace")
        names: set[str] = set()
        for c in spec.get("containers", []):
            names |= {p["name"] for p in c.get("ports", []) if "name" in p}
            for src in c.get("envFrom", []):
                for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
                    if key in src and (kind, ns, src[key]["name"]) not in have:
                        errors[_key(f, d)] = f"reads {kind} {src[key]['name']}, which is not in namespace {ns}"
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                port = ((c.get(probe) or {}).get("httpGet") or (c.get(probe) or {}).get("tcpSocket") or {}).get("port")
                if isinstance(port, str) and port not in names:
                    errors[_key(f, d)] = f"{probe} names port {port}, which no container declares"
        pods_ports[(ns, d["spec"]["selector"]["matchLabels"].get("app.kubernetes.io/name", ""))] = names
    for f, d in docs:
        if d["kind"] != "Service":
            continue
        app = d["spec"]["selector"].get("app.kubernetes.io/name", "")
        names = pods_ports.get((d["metadata"].get("namespace"), app))
        if names is None:
            errors[_key(f, d)] = f"selects app {app}, which no workload in its namespace runs"
            continue
        for p in d["spec"].get("ports", []):
            if isinstance(p.get("targetPort"), str) and p["targetPort"] not in names:
                errors[_key(f, d)] = f"targetPort {p['targetPort']} is not a container port of {app}"
    return errors


def _key(f: str, d: dict[str, Any]) -> str:
    return f"{f}:{d['kind']}/{d['metadata']['name']}"


def validate_all(root: Path = K8S_DIR) -> dict[str, str | None]:
    """Every rendered document under ``root`` (keys ``<file under root>:<kind>/<name>``) -> None when
    valid, else why not (see the module docstring).
    A kustomization that cannot be rendered is one entry with its error."""
    out: dict[str, str | None] = {}
    docs: list[tuple[str, dict[str, Any]]] = []
    for k in sorted(root.glob("*/kustomization.yaml")):
        try:
            docs += render(k, root)
        except ValueError as e:
            out[str(k.relative_to(root))] = str(e)
    for f, d in docs:
        out[_key(f, d)] = _schema_error(d)
    for key, err in cross_errors(docs).items():
        out[key] = out.get(key) or err
    return out
