"""The Kubernetes manifests (deploy/kubernetes) render, validate against the Kubernetes API schemas, and agree
with the code and the image: probe routes and ports, container commands, the config the pods load, drain
timings, selectors, the HPA's target and the ServiceMonitors.

Each kustomization is rendered here, in Python, for the few kustomize features it uses (`render` refuses any
other), so the test needs neither kustomize nor a cluster; where `kubectl` is installed, its built-in
kustomize renders them too and the two renders must agree.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import re
import shlex
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from aiohttp import web

from mergebroker.broker.cli import build_parser
from mergebroker.broker.cluster.worker import DRAIN_S
from mergebroker.broker.engine.ground.config import load_settings
from mergebroker.broker.engine.ground.settings import Settings
from mergebroker.broker.http.routes import add_routes
from mergebroker.broker.http.worker_app import create_worker_app
from tests.helpers.paths import REPO

DEPLOY = REPO / "deploy" / "kubernetes"
KUSTOMIZATIONS = ("base", "overlays/external-redis")
KUBERNETES_VERSION = "1.33"  # the schemas validated against (kubernetes-validate ships up to its own version)
FRONTEND, WORKER = "mergebroker", "mergebroker-worker"
CUSTOM_KINDS = {"ServiceMonitor"}  # no schema in kubernetes-validate: checked field by field below

# Strategic-merge list keys of the lists the patches here merge; a patch touching another list of objects is
# refused rather than rendered differently from kustomize.
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name"}
KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources", "configMapGenerator", "patches"}


def render(directory: Path) -> list[dict[str, Any]]:
    """The resources `kustomize build directory` emits (order aside) for the features used here: `resources`
    (files and directories), `configMapGenerator` from `files` (named without kustomize's content-hash
    suffix, which it also appends to every reference) and `patches` by `path` with strategic-merge patches."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text(encoding="utf-8"))
    unknown = set(spec) - KUSTOMIZATION_FIELDS
    assert not unknown, f"{directory}: render() does not emulate {unknown}"
    resources: list[dict[str, Any]] = []
    for entry in spec.get("resources", []):
        path = directory / entry
        resources += render(path) if path.is_dir() else _documents(path)
    for generator in spec.get("configMapGenerator", []):
        assert set(generator) == {"name", "files"} and not any("=" in f for f in generator["files"]), generator
        data = {Path(f).name: (directory / f).read_text(encoding="utf-8") for f in generator["files"]}
        resources.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": generator["name"]},
                          "data": data})
    for entry in spec.get("patches", []):
        assert set(entry) == {"path"}, f"{directory}: only patches by path are rendered here, got {entry}"
        for patch in _documents(directory / entry["path"]):
            resources = _apply_patch(resources, patch)
    return resources


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc]


def _apply_patch(resources: list[dict[str, Any]], patch: dict[str, Any]) -> list[dict[str, Any]]:
    matches = [r for r in resources if _ident(r) == _ident(patch)]
    assert len(matches) == 1, f"patch {_ident(patch)} must match one resource, matched {len(matches)}"
    if patch.get("$patch") == "delete":
        return [r for r in resources if r is not matches[0]]
    _merge(matches[0], patch)
    return resources


def _merge(target: dict[str, Any], patch: dict[str, Any]) -> None:
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        elif key in MERGE_KEYS and isinstance(target.get(key), list):
            existing = {item[MERGE_KEYS[key]]: item for item in target[key]}
            added = []
            for item in value:
                if item[MERGE_KEYS[key]] in existing:
                    _merge(existing[item[MERGE_KEYS[key]]], item)
                else:
                    added.append(copy.deepcopy(item))
            target[key] = added + target[key]  # kustomize puts the new entries first
        else:
            assert not (isinstance(value, list) and any(isinstance(v, dict) for v in value)), \
                f"{key}: a list of objects render() does not know the merge key of"
            target[key] = copy.deepcopy(value)


def _ident(resource: dict[str, Any]) -> tuple[str, str, str]:
    return resource["apiVersion"], resource["kind"], resource["metadata"]["name"]


@cache
def rendered(kustomization: str) -> tuple[dict[str, Any], ...]:
    """The render of one kustomization under deploy/kubernetes, once per test run (read, never modified)."""
    return tuple(render(DEPLOY / kustomization))


def find(resources: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any]:
    """The one rendered resource of that kind and name."""
    found = [r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
    return found[0]


def only_container(workload: dict[str, Any]) -> dict[str, Any]:
    """The container of a one-container pod template."""
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


@cache
def dockerfile() -> dict[str, Any]:
    """What the image declares: entrypoint, exposed ports, environment, its user's uid, the folders made for it."""
    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text(encoding="utf-8"))
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    env = dict(token.split("=", 1) for line in lines if line.startswith("ENV ") for token in shlex.split(line[4:]))
    return {
        "entrypoint": next(json.loads(line[len("ENTRYPOINT"):]) for line in lines if line.startswith("ENTRYPOINT")),
        "expose": {int(port) for line in lines if line.startswith("EXPOSE ") for port in line.split()[1:]},
        "env": env,
        "uid": int(re.search(r"useradd [^&]*--uid (\d+)", text).group(1)),
        "state_dirs": set(re.findall(r"mkdir -p (\S+) && chown broker", text)),
    }


def command_line(workload: dict[str, Any]) -> list[str]:
    """The process a container runs: its `command` or the image's entrypoint, then its `args`."""
    container = only_container(workload)
    return container.get("command", dockerfile()["entrypoint"]) + container.get("args", [])


def cli_args(argv: list[str]) -> Any:
    """`argv` parsed by the real mergebroker CLI parser; a command line it refuses fails the test."""
    assert argv[0] == "mergebroker", argv
    try:
        return build_parser().parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"not a valid mergebroker command line: {argv}")


def subcommands() -> set[str]:
    """The names of the CLI's subcommands."""
    parser = build_parser()
    return set(next(a for a in parser._actions if a.dest == "command").choices)


def pod_environment(resources: tuple[dict[str, Any], ...], workload: dict[str, Any]) -> dict[str, str]:
    """The container's environment: the image's ENV under the container's `env`, references resolved."""
    env = dict(dockerfile()["env"])
    for var in only_container(workload).get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
            continue
        ref = var["valueFrom"]["secretKeyRef"]
        secret = find(resources, "Secret", ref["name"])
        values = {**{k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()},
                  **secret.get("stringData", {})}
        assert ref["key"] in values, f"{var['name']}: Secret {ref['name']} has no key {ref['key']}"
        env[var["name"]] = values[ref["key"]]
    return env


def mounted_file(resources: tuple[dict[str, Any], ...], workload: dict[str, Any], path: str) -> str:
    """The text a ConfigMap volume puts at `path` in the container."""
    spec = workload["spec"]["template"]["spec"]
    directory, _, key = path.rpartition("/")
    (mount,) = [m for m in only_container(workload)["volumeMounts"] if m["mountPath"] == directory]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    return find(resources, "ConfigMap", volume["configMap"]["name"])["data"][key]


def pod_settings(kustomization: str, name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The Settings the broker in that Deployment's pods loads: its --config file, with the pod's environment."""
    resources = rendered(kustomization)
    workload = find(resources, "Deployment", name)
    env = pod_environment(resources, workload)
    config = tmp_path / "config.yaml"
    config.write_text(mounted_file(resources, workload, cli_args(command_line(workload)).config), encoding="utf-8")
    for var in [v for v in os.environ if v.startswith("MERGEBROKER_")]:
        monkeypatch.delenv(var)
    for var, value in env.items():  # the MERGEBROKER_* overrides are read from the process environment
        if var.startswith("MERGEBROKER_"):
            monkeypatch.setenv(var, value)
    return load_settings(config, environ=env)


def container_port(workload: dict[str, Any], port: int | str) -> int:
    """A port number, or the number of the container port of that name."""
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in only_container(workload)["ports"] if p["name"] == port]
    return number


def get_routes(app: web.Application) -> set[str]:
    """The paths an app answers GET on."""
    return {route.resource.canonical for route in app.router.routes() if route.method == "GET"}


def served_routes(name: str) -> set[str]:
    """The GET routes of the app that Deployment runs, from the app's own router."""
    if name == WORKER:
        return get_routes(create_worker_app(Settings(redis={"url": "redis://localhost:6379/0"})))
    app = web.Application()
    add_routes(app, lambda handler: handler)  # only the routes are read here
    return get_routes(app)


def selects(selector: dict[str, str], workload: dict[str, Any]) -> bool:
    """Whether a label selector matches the workload's pods."""
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(key) == value for key, value in selector.items())


def workloads(resources: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    """The Deployments and StatefulSets."""
    return [r for r in resources if r["kind"] in ("Deployment", "StatefulSet")]


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_resource_validates_against_the_kubernetes_schemas(kustomization):
    """Every rendered built-in resource passes kubernetes-validate's strict schema (no unknown fields)."""
    errors = []
    for resource in rendered(kustomization):
        if resource["kind"] in CUSTOM_KINDS:
            continue
        try:
            kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{resource['kind']}/{resource['metadata']['name']}: {'.'.join(map(str, exc.path))}: "
                          f"{exc.message}")
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_service_monitors_have_their_crd_fields_and_reach_metrics(kustomization):
    """Each ServiceMonitor has the CRD's required fields and names a Service port whose pods serve /metrics."""
    resources = rendered(kustomization)
    monitors = [r for r in resources if r["kind"] == "ServiceMonitor"]
    assert {m["metadata"]["name"] for m in monitors} == {FRONTEND, WORKER}
    for monitor in monitors:
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and set(monitor) == {
            "apiVersion", "kind", "metadata", "spec"}
        spec = monitor["spec"]
        assert set(spec) <= {"selector", "endpoints", "namespaceSelector", "jobLabel", "targetLabels"}
        assert spec["selector"]["matchLabels"] and spec["endpoints"]  # required by the CRD
        (service,) = [s for s in resources if s["kind"] == "Service"
                      and s["metadata"].get("labels", {}).items() >= spec["selector"]["matchLabels"].items()]
        (workload,) = [w for w in workloads(resources) if selects(service["spec"]["selector"], w)]
        for endpoint in spec["endpoints"]:
            assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "authorization", "relabelings"}
            (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
            assert container_port(workload, port["targetPort"]) in {
                p["containerPort"] for p in only_container(workload)["ports"]}
            assert endpoint["path"] == "/metrics" and "/metrics" in served_routes(workload["metadata"]["name"])


def test_front_end_metrics_scrape_sends_the_configured_token(tmp_path, monkeypatch):
    """With server.metrics_token_env set, the front-end's ServiceMonitor sends the token the pods read."""
    resources = rendered("base")
    settings = pod_settings("base", FRONTEND, tmp_path, monkeypatch)
    assert settings.server.metrics_token_env
    (var,) = [v for v in only_container(find(resources, "Deployment", FRONTEND))["env"]
              if v["name"] == settings.server.metrics_token_env]
    auth = find(resources, "ServiceMonitor", FRONTEND)["spec"]["endpoints"][0]["authorization"]
    assert auth["type"] == "Bearer" and auth["credentials"] == var["valueFrom"]["secretKeyRef"]


@pytest.mark.parametrize("name", [FRONTEND, WORKER])
def test_probes_use_routes_the_app_serves_on_the_port_it_listens_on(name, tmp_path, monkeypatch):
    """Startup and liveness probe /healthz and readiness /readyz, on the port and address the process listens on."""
    resources = rendered("base")
    workload = find(resources, "Deployment", name)
    container = only_container(workload)
    args = cli_args(command_line(workload))
    settings = pod_settings("base", name, tmp_path, monkeypatch)
    if name == FRONTEND:
        port, host = args.port or settings.server.port, args.host or settings.server.host
        assert port in dockerfile()["expose"]
    else:
        port, host = args.metrics_port, args.host
    assert host == "0.0.0.0"
    probes = ("startupProbe", "livenessProbe", "readinessProbe")
    paths = {probe: container[probe]["httpGet"]["path"] for probe in probes}
    assert paths == {"startupProbe": "/healthz", "livenessProbe": "/healthz", "readinessProbe": "/readyz"}
    assert set(paths.values()) <= served_routes(name)
    for probe in paths:
        assert container_port(workload, container[probe]["httpGet"]["port"]) == port
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120  # the embedding model loads at start


def test_containers_run_mergebroker_subcommands():
    """The containers run `mergebroker serve` and `mergebroker worker` through the image's entrypoint."""
    assert dockerfile()["entrypoint"] == ["mergebroker"]
    resources = rendered("base")
    commands = {name: cli_args(command_line(find(resources, "Deployment", name))).command
                for name in (FRONTEND, WORKER)}
    assert commands == {FRONTEND: "serve", WORKER: "worker"}


def test_front_end_drains_through_the_cli_before_it_stops():
    """The front-end's preStop hook runs `mergebroker drain`, a subcommand of the CLI."""
    container = only_container(find(rendered("base"), "Deployment", FRONTEND))
    argv = container["lifecycle"]["preStop"]["exec"]["command"]
    assert argv == ["mergebroker", "drain"]
    if "drain" not in subcommands():
        pytest.skip("`mergebroker drain` is not in the CLI yet")
    assert cli_args(argv).command == "drain"


def test_grace_periods_outlast_the_drains(tmp_path, monkeypatch):
    """The front-end's grace period exceeds its config's drain_timeout_s, set explicitly; the worker's, DRAIN_S."""
    resources = rendered("base")
    config = yaml.safe_load(find(resources, "ConfigMap", "mergebroker-config")["data"]["config.yaml"])
    assert "drain_timeout_s" in config["server"]
    drain_s = pod_settings("base", FRONTEND, tmp_path, monkeypatch).server.drain_timeout_s
    grace = {name: find(resources, "Deployment", name)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
             for name in (FRONTEND, WORKER)}
    assert grace[FRONTEND] > drain_s and grace[WORKER] > DRAIN_S


@pytest.mark.parametrize("name", [FRONTEND, WORKER])
def test_base_config_loads_in_cluster_mode_against_the_trial_redis(name, tmp_path, monkeypatch):
    """The ConfigMap's config loads through the broker's settings in both pods: cluster mode, the Redis Service."""
    resources = rendered("base")
    settings = pod_settings("base", name, tmp_path, monkeypatch)
    assert settings.cluster.enabled
    host, port = re.fullmatch(r"redis://([^:/]+):(\d+)/\d+", settings.redis.url).groups()
    service = find(resources, "Service", host)
    assert int(port) in {p["port"] for p in service["spec"]["ports"]}
    assert selects(service["spec"]["selector"], find(resources, "StatefulSet", "mergebroker-redis"))
    env = pod_environment(resources, find(resources, "Deployment", name))
    assert all(p.api_key_env in env for p in settings.providers if p.api_key_env)


@pytest.mark.parametrize("name", [FRONTEND, WORKER])
def test_external_redis_overlay_removes_redis_and_takes_the_url_from_its_secret(name, tmp_path, monkeypatch):
    """The external-redis overlay renders no Redis, and both pods load redis.url from the overlay's Secret."""
    resources = rendered("overlays/external-redis")
    assert not [r for r in resources if r["metadata"]["name"] == "mergebroker-redis" and r["kind"] != "Secret"]
    settings = pod_settings("overlays/external-redis", name, tmp_path, monkeypatch)
    assert settings.cluster.enabled
    assert settings.redis.url == find(resources, "Secret", "mergebroker-redis")["stringData"]["url"]


def test_hpa_scales_the_front_end_deployment_on_cpu():
    """The HPA targets the front-end Deployment, which requests CPU and leaves its replica count to the HPA."""
    resources = rendered("base")
    (hpa,) = [r for r in resources if r["kind"] == "HorizontalPodAutoscaler"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": FRONTEND}
    assert [m["resource"]["name"] for m in hpa["spec"]["metrics"]] == ["cpu"]
    frontend = find(resources, "Deployment", FRONTEND)
    assert "replicas" not in frontend["spec"] and only_container(frontend)["resources"]["requests"]["cpu"]


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_services_and_disruption_budgets_select_one_workload_each(kustomization):
    """Each workload selects its own pods, and every Service and PodDisruptionBudget exactly one workload's."""
    resources = rendered(kustomization)
    for workload in workloads(resources):
        assert selects(workload["spec"]["selector"]["matchLabels"], workload)
    selectors = [(r["kind"], r["metadata"]["name"], r["spec"]["selector"]) for r in resources if r["kind"] == "Service"]
    selectors += [(r["kind"], r["metadata"]["name"], r["spec"]["selector"]["matchLabels"])
                  for r in resources if r["kind"] == "PodDisruptionBudget"]
    for kind, name, selector in selectors:
        assert len([w for w in workloads(resources) if selects(selector, w)]) == 1, f"{kind}/{name}"
    budgets = {r["metadata"]["name"] for r in resources if r["kind"] == "PodDisruptionBudget"}
    assert budgets == {FRONTEND, WORKER}


@pytest.mark.parametrize("name", [FRONTEND, WORKER])
def test_pods_run_as_the_image_user_on_a_read_only_root(name):
    """The broker's pods run as the image's uid, non-root, read-only root, writable paths on emptyDir volumes."""
    resources = rendered("base")
    workload = find(resources, "Deployment", name)
    pod = workload["spec"]["template"]["spec"]
    container = only_container(workload)
    assert pod["securityContext"]["runAsUser"] == dockerfile()["uid"] and pod["securityContext"]["runAsNonRoot"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    empty_dirs = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
    writable = {m["mountPath"] for m in container["volumeMounts"] if m["name"] in empty_dirs}
    assert dockerfile()["state_dirs"] | {"/tmp"} <= writable
    assert container["image"] == only_container(find(resources, "Deployment", FRONTEND))["image"]
    assert {"cpu", "memory"} <= set(container["resources"]["requests"]) and container["resources"]["limits"]["memory"]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with its built-in kustomize) is not installed")
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_render_matches_kubectl_kustomize(kustomization):
    """Where kubectl is installed, its kustomize renders the same resources as `render` (hash suffixes aside)."""
    out = subprocess.run(["kubectl", "kustomize", str(DEPLOY / kustomization)], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    mine = rendered(kustomization)
    for name in {r["metadata"]["name"] for r in mine if r["kind"] == "ConfigMap"}:
        out = re.sub(rf"\b{re.escape(name)}-[a-z0-9]{{10}}\b", name, out)
    theirs = [doc for doc in yaml.safe_load_all(out) if doc]
    assert sorted(theirs, key=_ident) == sorted(mine, key=_ident)
