"""deploy/k8s: every overlay renders, validates against the Kubernetes and CRD schemas, and agrees
with the topics file, the settings and itself (pools, lag triggers, drain, devices)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

import topics
from tests.tools import need_tool
from topics.render import strimzi, with_profile
from worker.settings import load

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "cuda", "ascend", "pools")
KUBERNETES = "1.32"
# CRD schemas (KEDA, Strimzi) are fetched data kept outside the repository; see the README's Deploy section.
CRD_DIRS = [Path(p) for p in (os.environ.get("SLUICE_CRD_DIR"), ROOT.parent / "shared" / "crds",
                              Path("/work/shared/crds")) if p]

kubectl = pytest.mark.usefixtures("kubectl_installed")


@pytest.fixture
def kubectl_installed():
    need_tool("kubectl")  # it renders kustomize


def render(overlay: str) -> list[dict]:
    out = subprocess.run(["kubectl", "kustomize", str(K8S / "overlays" / overlay)], check=True,
                         capture_output=True, text=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def of_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def env_of(deployment) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in deployment["spec"]["template"]["spec"]
            ["containers"][0]["env"]}


def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> openAPIV3Schema, from the CRD files found."""
    out = {}
    for d in CRD_DIRS:
        for f in sorted(d.glob("*.yaml")) if d.is_dir() else ():
            for crd in yaml.safe_load_all(f.read_text()):
                if not crd or crd.get("kind") != "CustomResourceDefinition":
                    continue
                spec = crd["spec"]
                for v in spec["versions"]:
                    if v.get("served"):
                        out[(f"{spec['group']}/{v['name']}", spec["names"]["kind"])] = v["schema"]["openAPIV3Schema"]
    return out


@kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_renders_and_validates_against_the_kubernetes_schemas(overlay):
    import kubernetes_validate

    docs = render(overlay)
    core = [d for d in docs if not d["apiVersion"].startswith(("keda.sh/", "kafka.strimzi.io/"))]
    assert {d["kind"] for d in core} >= {"Deployment", "PodDisruptionBudget", "Service", "ConfigMap"}
    for d in core:
        kubernetes_validate.validate(d, KUBERNETES, strict=True)
    assert all(d["metadata"].get("namespace") == "sluice" for d in docs)


def test_the_validator_rejects_what_kubernetes_would():
    import kubernetes_validate

    bad = yaml.safe_load((K8S / "workers" / "deployment.yaml").read_text())
    bad["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "ninety"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES, strict=True)


@kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_custom_resources_validate_against_their_crds(overlay):
    import jsonschema

    schemas = crd_schemas()
    if not schemas:
        pytest.skip(f"no KEDA/Strimzi CRD files in {', '.join(map(str, CRD_DIRS))} (SLUICE_CRD_DIR)")
    custom = [d for d in render(overlay) if d["apiVersion"].startswith(("keda.sh/", "kafka.strimzi.io/"))]
    assert {d["kind"] for d in custom} == {"KafkaTopic", "ScaledObject", "TriggerAuthentication"}
    for d in custom:
        schema = schemas[(d["apiVersion"], d["kind"])]
        jsonschema.validate(d, schema)
    broken = next(d for d in custom if d["kind"] == "ScaledObject")
    broken["spec"]["minReplicaCount"] = "one"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schemas[(broken["apiVersion"], "ScaledObject")])


def test_strimzi_topics_are_the_topics_file_rendered_for_production():
    committed = (K8S / "shared" / "topics.yaml").read_text()
    catalog = topics.load()
    assert committed == strimzi(with_profile(catalog, "production")), \
        "run: sluice topics render --profile production --out deploy/k8s/shared/topics.yaml"
    rendered = {d["spec"]["topicName"]: d["spec"] for d in yaml.safe_load_all(committed) if d}
    assert set(rendered) == {t.name for t in catalog.topic}
    for t in catalog.topic:
        spec = rendered[t.name]
        assert (spec["partitions"], spec["replicas"]) == (t.partitions, 3)
        assert spec["config"] == {**t.config, "min.insync.replicas": "2"}


def test_the_dev_profile_keeps_the_topics_file_and_unknown_profiles_are_refused():
    catalog = topics.load()
    assert with_profile(catalog, "dev") == catalog
    with pytest.raises(ValueError, match="unknown profile"):
        with_profile(catalog, "staging")


def test_the_cluster_settings_file_loads_and_holds_no_credentials():
    path = K8S / "shared" / "sluice.toml"
    s = load(path, environ={})
    assert s.kafka.security_protocol == "SASL_SSL" and s.kafka.sasl_password is None
    assert "password" not in path.read_text().replace("SLUICE_KAFKA_SASL_PASSWORD", "")


@kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pools_scale_on_their_own_lag_and_drain_before_they_are_killed(overlay):
    docs = render(overlay)
    cluster = load(K8S / "shared" / "sluice.toml", environ={}).worker
    drain_s, stop_s = cluster.drain_grace_s, cluster.drain_grace_s + cluster.stop_margin_s
    class_topics = {t.latency_class: t.name for t in topics.load().requests}
    deployments = {d["metadata"]["name"]: d for d in of_kind(docs, "Deployment")}
    scaled = of_kind(docs, "ScaledObject")
    assert len(scaled) == len(deployments)
    served = set()
    for so in scaled:
        dep = deployments[so["spec"]["scaleTargetRef"]["name"]]
        env = env_of(dep)
        group = env.get("SLUICE_GROUP_ID", "sluice-workers")
        classes = env.get("SLUICE_CLASSES", "realtime,standard,batch").split(",")
        load(environ={"SLUICE_CLASSES": ",".join(classes)})  # a valid setting
        assert not served & set(classes), "two pools consume the same class"
        served |= set(classes)
        triggers = so["spec"]["triggers"]
        assert {t["metadata"]["topic"] for t in triggers} == {class_topics[c] for c in classes}
        assert all(t["metadata"]["consumerGroup"] == group for t in triggers)
        assert all(t["authenticationRef"]["name"] in {a["metadata"]["name"]
                                                      for a in of_kind(docs, "TriggerAuthentication")} for t in triggers)
        pod = dep["spec"]["template"]["spec"]
        # the worker's own bound on its shutdown ends it before the kubelet's SIGKILL
        assert pod["terminationGracePeriodSeconds"] > stop_s
        assert so["spec"]["cooldownPeriod"] > drain_s
        probes = pod["containers"][0]
        assert (probes["readinessProbe"]["httpGet"]["path"], probes["livenessProbe"]["httpGet"]["path"]) == \
            ("/readyz", "/healthz")
        pdbs = [p for p in of_kind(docs, "PodDisruptionBudget")
                if p["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()]
        assert len(pdbs) == 1, dep["metadata"]["name"]
        config_maps = {c["metadata"]["name"] for c in of_kind(docs, "ConfigMap")}
        assert {v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v} <= config_maps
    assert served == set(class_topics), "a class no pool consumes"
    if overlay == "pools":
        assert len(deployments) == 2


@kubectl
@pytest.mark.parametrize("overlay,device,resource", [("cpu", "cpu", None), ("cuda", "cuda", "nvidia.com/gpu"),
                                                     ("ascend", "npu", "huawei.com/Ascend910"),
                                                     ("pools", "cuda", "nvidia.com/gpu")])
def test_each_accelerator_overlay_asks_for_its_device(overlay, device, resource):
    for dep in of_kind(render(overlay), "Deployment"):
        container = dep["spec"]["template"]["spec"]["containers"][0]
        assert env_of(dep)["SLUICE_DEVICE"] == device
        assert container["image"].endswith(":" + ("ascend" if device == "npu" else device))
        limits = container["resources"]["limits"]
        assert (limits.get(resource) == "1") if resource else not any("/" in k for k in limits)
