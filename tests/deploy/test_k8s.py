"""The Kubernetes manifests in docker/k8s, checked offline.

Core kinds (Deployment, Service, PodDisruptionBudget, and every pod template, the RayService's included) are
validated strictly against Kubernetes' own OpenAPI schemas by the ``kubernetes-validate`` package; the custom
resources (KEDA's ScaledObject, the Prometheus Operator's ServiceMonitor, KubeRay's RayService) get structural
checks. Then what must agree across files: probes on /live and /health, a termination grace longer than the
drain, selectors and ports, GPU requests, the autoscaling query's series, and the RayService's embedded Serve
config equal to docker/ray/serve-gpu.yaml.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.deploy import promql
from tests.deploy.conftest import DOCKER
from tests.deploy.exported_metrics import Family

kubernetes_validate = pytest.importorskip("kubernetes_validate")

K8S = DOCKER / "k8s"
KUBERNETES_VERSION = "1.30.0"  # the oldest version the manifests target (the preStop sleep action is 1.30+)
NAME = "lookahead-server"
GPU = "nvidia.com/gpu"


def load(name: str) -> dict:
    documents = [doc for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]
    assert len(documents) == 1, name
    return documents[0]


@pytest.fixture(scope="module")
def manifests() -> dict[str, dict]:
    """Every manifest by kind."""
    found = {}
    for path in sorted(K8S.glob("*.yaml")):
        document = load(path.name)
        assert document["kind"] not in found, f"two manifests of kind {document['kind']}"
        found[document["kind"]] = document
    return found


def validate(document: dict) -> None:
    """Strict validation against Kubernetes' schema (unknown fields are errors); raises with the reason."""
    kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)


def pod_template(template: dict) -> dict:
    """A pod template wrapped as the core ``PodTemplate`` kind, so that it can be validated on its own."""
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "check"}, "template": template}


def container(deployment: dict) -> dict:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_the_expected_kinds_are_there(manifests):
    assert set(manifests) == {"Deployment", "Service", "PodDisruptionBudget", "ServiceMonitor", "ScaledObject",
                              "RayService"}


@pytest.mark.parametrize("kind", ["Deployment", "Service", "PodDisruptionBudget"])
def test_core_kinds_are_valid(manifests, kind):
    validate(manifests[kind])


def test_a_broken_manifest_is_caught(manifests):
    broken = yaml.safe_load(yaml.safe_dump(manifests["Deployment"]))
    container(broken)["readinessProbe"]["httpGet"]["prot"] = 8000  # a typo of "port"
    with pytest.raises(Exception, match="prot"):
        validate(broken)


def test_probes_separate_liveness_from_readiness(manifests):
    server = container(manifests["Deployment"])
    assert server["readinessProbe"]["httpGet"]["path"] == "/health"
    assert server["livenessProbe"]["httpGet"]["path"] == "/live"
    startup = server["startupProbe"]
    assert startup["httpGet"]["path"] == "/live"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300  # a first start downloads the model


def test_the_termination_grace_outlasts_the_drain(manifests):
    from server.cli import build_config, build_parser

    spec = manifests["Deployment"]["spec"]["template"]["spec"]
    server = container(manifests["Deployment"])
    config = build_config(build_parser().parse_args(["serve", *server["args"]]))
    pre_stop = server["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert spec["terminationGracePeriodSeconds"] > pre_stop + config.drain_grace_seconds
    assert config.host == "0.0.0.0" and str(config.port) == str(server["ports"][0]["containerPort"])


def test_gpu_requests_equal_limits(manifests):
    resources = container(manifests["Deployment"])["resources"]
    assert resources["requests"][GPU] == resources["limits"][GPU] == 1
    tolerations = manifests["Deployment"]["spec"]["template"]["spec"]["tolerations"]
    assert any(toleration["key"] == GPU for toleration in tolerations)


def test_selectors_ports_and_targets_agree(manifests):
    deployment, service = manifests["Deployment"], manifests["Service"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    assert manifests["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"] == selector
    port_names = {port["name"] for port in container(deployment)["ports"]}
    assert all(port["targetPort"] in port_names for port in service["spec"]["ports"])
    monitor = manifests["ServiceMonitor"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    service_ports = {port["name"] for port in service["spec"]["ports"]}
    assert {endpoint["port"] for endpoint in monitor["spec"]["endpoints"]} <= service_ports
    assert manifests["ScaledObject"]["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"] == NAME


def test_the_pdb_leaves_pods_serving(manifests):
    budget = manifests["PodDisruptionBudget"]["spec"]
    assert budget.get("maxUnavailable") == 1 or budget.get("minAvailable", 0) >= 1
    assert manifests["ScaledObject"]["spec"]["minReplicaCount"] >= 1


def autoscaling_query(manifests) -> str:
    (trigger,) = manifests["ScaledObject"]["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    return trigger["metadata"]["query"]


def test_keda_scales_on_the_waiting_requests(manifests, exported: dict[str, Family]):
    spec = manifests["ScaledObject"]
    assert spec["apiVersion"] == "keda.sh/v1alpha1"
    assert spec["spec"]["maxReplicaCount"] > spec["spec"]["minReplicaCount"]
    (trigger,) = spec["spec"]["triggers"]
    assert float(trigger["metadata"]["threshold"]) > 0
    parsed = promql.parse(autoscaling_query(manifests))
    assert parsed.metrics == {"lookahead_requests_waiting"} and "lookahead_requests_waiting" in exported
    # the job label Prometheus Operator gives a ServiceMonitor's series is the Service's name
    assert f'job="{manifests["Service"]["metadata"]["name"]}"' in autoscaling_query(manifests)


def test_the_service_monitor_scrapes_metrics(manifests):
    monitor = manifests["ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert [endpoint["path"] for endpoint in monitor["spec"]["endpoints"]] == ["/metrics"]


def test_the_rayservice_embeds_the_gpu_serve_config(manifests):
    service = manifests["RayService"]
    assert service["apiVersion"] == "ray.io/v1"
    embedded = yaml.safe_load(service["spec"]["serveConfigV2"])
    assert embedded == yaml.safe_load((DOCKER / "ray" / "serve-gpu.yaml").read_text())


def test_the_rayservice_pods_are_valid_and_fit_a_replica(manifests):
    cluster = manifests["RayService"]["spec"]["rayClusterConfig"]
    validate(pod_template(cluster["headGroupSpec"]["template"]))
    (workers,) = cluster["workerGroupSpecs"]
    validate(pod_template(workers["template"]))
    assert workers["minReplicas"] <= workers["replicas"] <= workers["maxReplicas"]
    (application,) = yaml.safe_load(manifests["RayService"]["spec"]["serveConfigV2"])["applications"]
    args = application["args"]
    (worker,) = workers["template"]["spec"]["containers"]
    assert worker["resources"]["requests"][GPU] >= args["num_gpus"] > 0
    assert float(worker["resources"]["requests"]["cpu"]) >= args["num_cpus"]
    max_replicas_per_pod = worker["resources"]["requests"][GPU] // args["num_gpus"]
    assert workers["maxReplicas"] * max_replicas_per_pod >= args["max_replicas"]
    grace = workers["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > args["overrides"]["drain_grace_seconds"]
    assert cluster["enableInTreeAutoscaling"] is True  # the Ray autoscaler adds pods when Serve adds replicas


def test_the_rayservice_ray_version_is_the_one_tested():
    ray = pytest.importorskip("ray")
    cluster = load("rayservice.yaml")["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == ray.__version__


def test_every_manifest_file_is_checked():
    assert {path.name for path in Path(K8S).glob("*")} == {
        "deployment.yaml", "service.yaml", "pdb.yaml", "servicemonitor.yaml", "scaledobject.yaml", "rayservice.yaml"}
