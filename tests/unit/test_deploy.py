"""deploy/k8s: every overlay renders, validates against the Kubernetes and CRD schemas, and agrees
with the topics file, the settings and itself (pools, lag triggers, drain, devices)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

import topics
from tests.tools import missing, need_tool
from topics.render import strimzi, with_profile
from worker.settings import load

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "cuda", "ascend", "pools")
KUBERNETES = "1.32"
# KEDA and Strimzi resources are checked by validators generated from their CRDs, published on npm
# (.ci/run: npm install --prefix .sluice/node @kubernetes-models/keda @kubernetes-models/strimzi-kafka-operator).
NODE_HOME = ROOT / ".sluice" / "node"
CRD_MODELS = ("keda", "strimzi-kafka-operator")
CUSTOM = ("keda.sh/", "kafka.strimzi.io/")

kubectl = pytest.mark.usefixtures("kubectl_installed")


@pytest.fixture
def kubectl_installed():
    need_tool("kubectl")  # it renders kustomize


def render(overlay: str, where: Path = K8S / "overlays") -> list[dict]:
    out = subprocess.run(["kubectl", "kustomize", str(where / overlay)], check=True,
                         capture_output=True, text=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def of_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def env_of(deployment) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in deployment["spec"]["template"]["spec"]
            ["containers"][0]["env"]}


def crd_verdicts(docs: list[dict], tmp_path: Path) -> dict[tuple[str, str], str | None]:
    """(kind, name) -> the CRD validator's error for each custom resource, None where it is valid."""
    node = need_tool("node", "nodejs")
    if not all((NODE_HOME / "node_modules" / "@kubernetes-models" / m).is_dir() for m in CRD_MODELS):
        missing("crd-models", f"@kubernetes-models/{{{','.join(CRD_MODELS)}}} are not installed under {NODE_HOME} "
                              "(see .ci/run)")
    path = tmp_path / "resources.json"
    path.write_text(json.dumps(docs))
    out = subprocess.run([node, str(ROOT / "tests" / "crd_validate.cjs"), str(NODE_HOME / "node_modules"), str(path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    return {(v["kind"], v["name"]): v["error"] for v in lines}


@kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_renders_and_validates_against_the_kubernetes_schemas(overlay):
    import kubernetes_validate

    docs = render(overlay)
    core = [d for d in docs if not d["apiVersion"].startswith(CUSTOM)]
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
def test_custom_resources_validate_against_their_crds(overlay, tmp_path):
    custom = [d for d in render(overlay) if d["apiVersion"].startswith(CUSTOM)]
    assert {d["kind"] for d in custom} == {"KafkaTopic", "ScaledObject", "TriggerAuthentication"}
    verdicts = crd_verdicts(custom, tmp_path)
    assert len(verdicts) == len(custom)
    assert {resource: error for resource, error in verdicts.items() if error} == {}
    # the validator refuses what the CRD does: a count that is not an integer, a topic with no partitions
    scaled = next(d for d in custom if d["kind"] == "ScaledObject")
    topic = next(d for d in custom if d["kind"] == "KafkaTopic")
    broken = [{**scaled, "spec": {**scaled["spec"], "minReplicaCount": "one"}},
              {**topic, "spec": {**topic["spec"], "partitions": 0}}]
    refused = crd_verdicts(broken, tmp_path)
    assert "minReplicaCount must be integer" in refused[("ScaledObject", scaled["metadata"]["name"])]
    assert "partitions must be >= 1" in refused[("KafkaTopic", topic["metadata"]["name"])]


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
    path = K8S / "settings" / "sluice.toml"
    s = load(path, environ={})
    assert s.kafka.security_protocol == "SASL_SSL" and s.kafka.sasl_password is None
    assert "password" not in path.read_text().replace("SLUICE_KAFKA_SASL_PASSWORD", "")


@kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pools_scale_on_their_own_lag_and_drain_before_they_are_killed(overlay):
    docs = render(overlay)
    cluster = load(K8S / "settings" / "sluice.toml", environ={}).worker
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


@kubectl
def test_the_backfill_job_validates_reads_the_workers_settings_and_runs_a_range_the_cli_accepts():
    import kubernetes_validate

    from worker.cli import build_parser

    docs = render("backfill", K8S)
    for d in docs:
        kubernetes_validate.validate(d, KUBERNETES, strict=True)
    (job,) = of_kind(docs, "Job")
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    # the same ConfigMap (by its generated name) and Secrets as the workers
    workers = of_kind(render("cpu"), "Deployment")[0]
    assert of_kind(docs, "ConfigMap")[0]["metadata"]["name"] == \
        next(v["configMap"]["name"] for v in workers["spec"]["template"]["spec"]["volumes"] if "configMap" in v)
    env = env_of(job)
    assert env["SLUICE_REDIS_URL"] == env_of(workers)["SLUICE_REDIS_URL"]  # the lease lives there
    assert env["SLUICE_KAFKA_SASL_PASSWORD"] == env_of(workers)["SLUICE_KAFKA_SASL_PASSWORD"]
    # arguments the command accepts, a fixed range (a retry without its checkpoint scores the same
    # events), and the checkpoint on a writable volume
    args = build_parser().parse_args(container["args"])
    assert args.command == "backfill" and args.name and args.start and args.stop and not args.no_lease
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert args.state_dir in mounts and container["securityContext"]["readOnlyRootFilesystem"]
    # no replacement while the pod before it runs; refused arguments end the Job instead of retrying
    assert job["spec"]["podReplacementPolicy"] == "Failed" and pod["restartPolicy"] == "Never"
    (rule,) = job["spec"]["podFailurePolicy"]["rules"]
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(["backfill", "--source", "t"])
    assert rule["action"] == "FailJob" and rule["onExitCodes"]["values"] == [refused.value.code] == [2]


def test_topics_render_writes_the_production_profile_unless_told_otherwise(capsys):
    from worker.cli import main

    assert main(["topics", "render"]) == 0
    rendered = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    assert rendered and all(d["spec"]["replicas"] == 3 for d in rendered)
    assert main(["topics", "render", "--profile", "dev"]) == 0
    dev = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    assert [d["spec"]["replicas"] for d in dev] == [t.replication_factor for t in topics.load().topic]
