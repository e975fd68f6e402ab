"""The fleet's deploy files keep their promises (issue 23 item 8): docker/compose-fleet.yaml with
docker/kvstore-fleet.toml, k8s/kvstore-fleet.yaml and k8s/kvstore-gateway.yaml.

Each `kvstore` command parses by the real CLI and each TOML loads as `kvstore serve` would load it
(tests/deploy/test_deploy_files.py's checks), with the variables the file sets for each node. Beyond
names: three nodes, each on its own data volume, advertising an address that reaches it; one copy
fewer than the nodes may be lost (replication <= nodes; the disruption budget lets one node go at a
time); the etcd endpoints and Redis Cluster members every node names are services of the same file;
stop timeouts beyond server.grace_s. The gateway's commands are checked once `kvstore gateway` is in
the CLI (issue 23 item 6); until then those tests skip, saying so.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvstore.cli import build_parser
from kvstore.config import Settings
from kvstore.fleet.endpoints import parse_endpoints
from tests.deploy.test_deploy_files import (
    DEPLOY,
    _seconds,
    assert_secured,
    dockerfile_entrypoint,
    dockerfile_env,
    kvstore_command,
    path_settings,
    settings_of,
    under,
)

COMPOSE = DEPLOY / "docker" / "compose-fleet.yaml"
K8S_FLEET = DEPLOY / "k8s" / "kvstore-fleet.yaml"
K8S_GATEWAY = DEPLOY / "k8s" / "kvstore-gateway.yaml"
#: The namespace the Kubernetes checks expand $(POD_NAMESPACE) to.
NAMESPACE = "kvstore"
#: etcd's official images (etcd.io: gcr.io is the primary registry, quay.io the secondary), 3.4 or 3.5.
ETCD_IMAGE = re.compile(r"(quay\.io/coreos|gcr\.io/etcd-development)/etcd:v3\.[45]\.\d+")


def gateway_in_cli() -> bool:
    """Whether the real parser has a `gateway` command."""
    parser = build_parser(["gateway"])
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return "gateway" in commands.choices


needs_gateway = pytest.mark.skipif(not gateway_in_cli(), reason="`kvstore gateway` is not in the CLI yet "
                                   "(issue 23 item 6): the gateway's deploy entries are checked once it parses")


def split_host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    assert host and port.isdigit(), f"{address!r} is not host:port"
    return host, int(port)


# -- docker compose --


def compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return doc


def binds_of(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> what is mounted there (a named volume or a path relative to the file)."""
    return {v.split(":")[1]: v.split(":")[0] for v in service.get("volumes", [])}


def kvstore_services(services: dict[str, Any], command: str) -> dict[str, dict[str, Any]]:
    """The services that run `kvstore <command>`."""
    return {name: s for name, s in services.items() if s.get("command", [None])[0] == command}


def compose_settings(service: dict[str, Any]) -> Settings:
    """The settings `kvstore <command> --config` loads in this service's container, with its variables."""
    args = kvstore_command(dockerfile_entrypoint() + service["command"])
    config = (COMPOSE.parent / binds_of(service)[str(args.config)]).resolve()  # the file mounted at --config
    env = service.get("environment", {})
    assert (dockerfile_env() | env)["KVSTORE_CONFIG"] == str(args.config)  # docker exec's kvstore finds it too
    return settings_of(config, env)


def served_paths(s: Settings, *, stores: bool) -> list[str]:
    """The paths a process opens: a gateway holds no store, so its settings' data dir is never opened."""
    return [p for p in path_settings(s) if stores or p != str(s.store.data_dir)]


def check_compose_server(name: str, service: dict[str, Any], s: Settings, services: dict[str, Any], *,
                         stores: bool = True) -> None:
    """What a node and the gateway share: secured, mounted, probed, stopped cleanly, on the fleet's etcd."""
    assert_secured(s)
    binds = binds_of(service)
    for path in served_paths(s, stores=stores):
        assert under(path, list(binds)), f"{name}: {path} is not mounted into the container"
    assert _seconds(service["stop_grace_period"]) > s.server.grace_s, name
    assert service["stop_signal"] == "SIGTERM"
    health = service["healthcheck"]["test"]
    assert health[0] == "CMD"
    probe = kvstore_command(health[1:])
    assert under(probe.tls_ca, list(binds)) and probe.target.endswith(f":{s.server.port}")
    assert s.fleet.enabled, f"{name}: [fleet] etcd is not set"
    assert not s.auth.tenants_file, f"{name}: a tenants file beside etcd's table is refused (tokens live in etcd)"
    for endpoint in parse_endpoints(s.fleet.etcd):
        assert endpoint.host in services, f"{name}: etcd endpoint {endpoint} is no service of {COMPOSE.name}"
        etcd = services[endpoint.host]["command"]
        assert etcd[etcd.index("--advertise-client-urls") + 1] == f"http://{endpoint}"
    assert "etcd" in service["depends_on"]


def test_compose_fleet_runs_three_nodes_each_on_its_own_volume() -> None:
    doc = compose()
    services = doc["services"]
    nodes = kvstore_services(services, "serve")
    assert len(nodes) == 3
    volumes, advertised, shared = set(), set(), set()
    for name, node in nodes.items():
        s = compose_settings(node)
        check_compose_server(name, node, s, services)
        data = binds_of(node)[str(s.store.data_dir)]
        assert data in doc["volumes"], f"{name}: its data dir is not on a named volume"
        volumes.add(data)
        # The address the others dial: this service on the compose network, at its gRPC port.
        host, port = split_host_port(s.fleet.advertise)
        assert host in (name, node.get("hostname")) and port == s.server.port, f"{name} advertises {s.fleet.advertise}"
        advertised.add(s.fleet.advertise)
        assert node.get("hostname") == name  # a node's record names its host (F2): one per container
        assert 1 <= s.fleet.replication <= len(nodes)
        assert s.swa.backend == "redis-cluster"
        for member in s.swa.cluster_nodes.split(","):
            assert split_host_port(member)[0] in services, f"{name}: Redis member {member} is no service here"
        assert node["depends_on"]["redis-cluster-create"]["condition"] == "service_completed_successfully"
        shared.add(repr(dataclasses.replace(s, fleet=dataclasses.replace(s.fleet, advertise=""))))
    assert len(volumes) == len(nodes), "two nodes share a data volume"
    assert len(advertised) == len(nodes), "two nodes advertise one address"
    assert len(shared) == 1, "the nodes' settings differ beyond their address"  # every node places alike (F8)


def test_compose_fleet_redis_is_a_cluster_of_six_made_by_a_one_shot_job() -> None:
    services = compose()["services"]
    members = {name: s for name, s in services.items() if "--cluster-enabled" in s.get("command", [])}
    assert len(members) == 6
    for s in members.values():
        assert re.fullmatch(r"redis:7(\.\d+)*", s["image"])  # the plain image: cluster mode by its flags
        assert s["command"][s["command"].index("--cluster-enabled") + 1] == "yes"
    (job,) = [s for s in services.values() if "redis-cli --cluster create" in " ".join(s.get("command", []))]
    script = job["command"][-1]
    assert set(re.findall(r"\bredis-\d+\b", script)) == set(members)  # it joins every member, no other
    assert "--cluster-replicas 1" in script and job["restart"] == "no"
    assert set(job["depends_on"]) == set(members)


def test_compose_fleet_leaves_nothing_for_compose_to_interpolate() -> None:
    """Compose replaces $NAME and ${NAME} from the host's environment: a shell's $ is written $$."""
    for path in (COMPOSE, DEPLOY / "docker" / "compose.yaml"):
        assert "$" not in path.read_text().replace("$$", ""), f"{path.name} has a $ compose would replace"


def test_compose_fleet_certificate_names_every_address_it_is_dialled_at(tmp_path: Path) -> None:
    """The test CA's certificate, made as the file's header says, names each node's advertised host and the
    gateway's; each node's fleet token is the file that script makes."""
    line = re.search(r"^#\s+(deploy/docker/make-test-certs\.sh deploy/docker/certs .*)$", COMPOSE.read_text(), re.M)
    assert line, "compose-fleet.yaml does not say how to make its certificates"
    argv = shlex.split(line.group(1))
    services = compose()["services"]
    nodes = kvstore_services(services, "serve")
    dialled = {split_host_port(compose_settings(n).fleet.advertise)[0] for n in nodes.values()}
    dialled |= {s["hostname"] for s in kvstore_services(services, "gateway").values()}
    for service in [*nodes.values(), *kvstore_services(services, "gateway").values()]:  # the health checks' names
        test = service["healthcheck"]["test"]
        dialled.add(test[test.index("--tls-server-name") + 1])
    assert dialled <= set(argv[2:])
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    subprocess.run(["bash", str(DEPLOY / "docker" / "make-test-certs.sh"), str(tmp_path), *argv[2:]], check=True,
                   capture_output=True, timeout=60)
    san = subprocess.run(["openssl", "x509", "-in", str(tmp_path / "tls.crt"), "-noout", "-ext", "subjectAltName"],
                         check=True, capture_output=True, text=True).stdout
    assert dialled <= set(re.findall(r"DNS:([\w.-]+)", san))
    for node in nodes.values():
        token = binds_of(node)[compose_settings(node).fleet.token_file]
        assert token.startswith("./certs/") and (tmp_path / token.removeprefix("./certs/")).stat().st_size >= 16


@needs_gateway
def test_compose_fleet_gateway_is_stateless_on_the_fleets_etcd() -> None:
    doc = compose()
    services = doc["services"]
    (name, gateway), = kvstore_services(services, "gateway").items()
    s = compose_settings(gateway)
    check_compose_server(name, gateway, s, services, stores=False)
    assert not set(binds_of(gateway).values()) & set(doc["volumes"]), "the gateway keeps state on a volume"
    published = {int(str(p).rsplit(":", 1)[1]) for p in gateway["ports"]}
    assert s.server.port in published
    assert set(kvstore_services(services, "serve")) <= set(gateway["depends_on"])


# -- Kubernetes --


def manifests(*paths: Path) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for p in paths for d in yaml.safe_load_all(p.read_text())}


def of_kind(docs: dict[tuple[str, str], dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {name: d for (k, name), d in docs.items() if k == kind}


def pod_env(container: dict[str, Any], pod: str) -> dict[str, str]:
    """The container's variables in pod `pod`, expanded as the kubelet does: fieldRefs, then $(NAME) of earlier ones."""
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "valueFrom" in e:
            field = e["valueFrom"]["fieldRef"]["fieldPath"]
            env[e["name"]] = {"metadata.name": pod, "metadata.namespace": NAMESPACE}[field]
        else:
            env[e["name"]] = expand(e["value"], env)
    return env


def expand(text: str, env: dict[str, str]) -> str:
    """$(NAME) replaced from `env`; a $(NAME) not defined there would reach the process as it is: refused."""
    for name in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", text):
        assert name in env, f"$({name}) in {text!r} names no variable defined before it"
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m.group(1)], text)


def pod_of(host: str, docs: dict[tuple[str, str], dict[str, Any]]) -> tuple[str, int]:
    """The StatefulSet and ordinal of a pod's DNS name `<set>-<i>.<service>[.<namespace>.svc.cluster.local]`."""
    labels = host.split(".")
    assert labels[2:] in ([], [NAMESPACE, "svc", "cluster", "local"]), f"{host}: not a pod name of this namespace"
    service = docs.get(("Service", labels[1]))
    assert service and service["spec"].get("clusterIP") == "None", f"{host}: {labels[1]} is no headless Service here"
    for name, sts in of_kind(docs, "StatefulSet").items():
        match = re.fullmatch(rf"{re.escape(name)}-(\d+)", labels[0])
        if match and sts["spec"]["serviceName"] == labels[1]:
            assert int(match.group(1)) < sts["spec"]["replicas"], f"{host}: no such pod"
            assert service["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
            return name, int(match.group(1))
    raise AssertionError(f"{host}: no StatefulSet of this file has that pod")


def k8s_settings(docs: dict[tuple[str, str], dict[str, Any]], pod_spec: dict[str, Any], pod: str,
                 tmp_path: Path) -> tuple[Any, Settings]:
    """(the parsed command, the settings) of the pod's one container, as `kvstore` loads them in pod `pod`."""
    (container,) = pod_spec["containers"]
    env = pod_env(container, pod)
    args = kvstore_command(dockerfile_entrypoint() + [expand(a, env) for a in container["args"]])
    mount = {m["mountPath"]: m for m in container["volumeMounts"]}[str(args.config)]
    volume = next(v for v in pod_spec["volumes"] if v["name"] == mount["name"])
    toml = tmp_path / f"{pod}.toml"
    toml.write_text(docs[("ConfigMap", volume["configMap"]["name"])]["data"][mount["subPath"]])
    return args, settings_of(toml, {k: v for k, v in env.items() if k.startswith("KVSTORE_")})


def check_k8s_server(docs: dict[tuple[str, str], dict[str, Any]], pod_spec: dict[str, Any], s: Settings,
                     service_name: str, *, stores: bool = True) -> None:
    """What a node and a gateway share: secured, mounted, probed, its ports served, stopped cleanly."""
    (container,) = pod_spec["containers"]
    assert_secured(s)
    assert s.fleet.enabled and not s.auth.tenants_file  # tokens live in etcd: a tenants file beside it is refused
    mounts = [m["mountPath"] for m in container["volumeMounts"]]
    for path in served_paths(s, stores=stores):
        assert under(path, mounts), f"{path} is not mounted into the pod"
    for v in pod_spec["volumes"]:  # every Secret and ConfigMap named is in the files
        if "secret" in v:
            assert ("Secret", v["secret"]["secretName"]) in docs
        if "configMap" in v:
            assert ("ConfigMap", v["configMap"]["name"]) in docs
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (ports["grpc"], ports["metrics"]) == (s.server.port, s.metrics.port)
    assert {p["targetPort"] for p in docs[("Service", service_name)]["spec"]["ports"]} == set(ports)
    assert pod_spec["terminationGracePeriodSeconds"] > s.server.grace_s
    for kind in ("startupProbe", "readinessProbe"):  # the gRPC health service, over TLS
        probe = kvstore_command(container[kind]["exec"]["command"])
        assert under(probe.tls_ca, mounts) and probe.target.endswith(f":{s.server.port}")
    assert pod_spec["securityContext"]["runAsNonRoot"] and not container["securityContext"]["allowPrivilegeEscalation"]
    for endpoint in parse_endpoints(s.fleet.etcd):  # the fleet's etcd is this file's
        sts, _ = pod_of(endpoint.host, docs)
        (etcd,) = docs[("StatefulSet", sts)]["spec"]["template"]["spec"]["containers"]
        assert endpoint.port in {p["containerPort"] for p in etcd["ports"] if p["name"] == "client"}


def node_set(docs: dict[tuple[str, str], dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    (found,) = [(n, d) for n, d in of_kind(docs, "StatefulSet").items()
                if d["spec"]["template"]["spec"]["containers"][0].get("args", [None])[0] == "serve"]
    return found


def image_of(sts: dict[str, Any]) -> str:
    image: str = sts["spec"]["template"]["spec"]["containers"][0]["image"]
    return image


def budget_of(docs: dict[tuple[str, str], dict[str, Any]], labels: dict[str, str]) -> dict[str, Any]:
    (pdb,) = [d for d in of_kind(docs, "PodDisruptionBudget").values()
              if d["spec"]["selector"]["matchLabels"].items() <= labels.items()]
    return pdb


def test_kubernetes_fleet_nodes_are_a_statefulset_on_local_nvme(tmp_path: Path) -> None:
    docs = manifests(K8S_FLEET)
    name, sts = node_set(docs)
    pod_spec = sts["spec"]["template"]["spec"]
    replicas = sts["spec"]["replicas"]
    assert replicas >= 3
    advertised = set()
    for ordinal in range(replicas):
        pod = f"{name}-{ordinal}"
        _, s = k8s_settings(docs, pod_spec, pod, tmp_path)
        check_k8s_server(docs, pod_spec, s, sts["spec"]["serviceName"])
        assert s.fleet.enabled
        # Its stable identity: the pod's own name through the headless Service, at its gRPC port.
        host, port = split_host_port(s.fleet.advertise)
        assert pod_of(host, docs) == (name, ordinal) and port == s.server.port, s.fleet.advertise
        advertised.add(s.fleet.advertise)
        assert 2 <= s.fleet.replication <= replicas
        for member in s.swa.cluster_nodes.split(","):  # the SWA pool's Redis Cluster is this file's
            pod_of(split_host_port(member)[0], docs)
    assert len(advertised) == replicas
    assert docs[("Service", sts["spec"]["serviceName"])]["spec"]["publishNotReadyAddresses"]
    # Each pod's own claim, on a local class that binds where the pod is scheduled, big enough for the store.
    (container,) = pod_spec["containers"]
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    data_mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(s.store.data_dir))
    assert data_mount["name"] == claim["metadata"]["name"]
    storage_class = docs[("StorageClass", claim["spec"]["storageClassName"])]
    assert storage_class["volumeBindingMode"] == "WaitForFirstConsumer"
    assert re.fullmatch(r"\d+Gi", claim["spec"]["resources"]["requests"]["storage"])
    claim_bytes = int(claim["spec"]["resources"]["requests"]["storage"][:-2]) << 30
    assert claim_bytes >= s.store.capacity_bytes * 1.2, "LMDB's pages need about a fifth more than the capacity"
    assert any(d["kind"] == "PersistentVolume" and "local" in d["spec"] for d in docs.values())
    # Two copies of a block never on one machine.
    (term,) = pod_spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()


def test_kubernetes_fleet_nodes_go_one_at_a_time() -> None:
    """A rolling restart or a drain takes one node at a time: the other copy serves meanwhile."""
    docs = manifests(K8S_FLEET)
    _, sts = node_set(docs)
    pdb = budget_of(docs, sts["spec"]["template"]["metadata"]["labels"])
    assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
    assert sts["spec"].get("updateStrategy", {}).get("type", "RollingUpdate") == "RollingUpdate"
    assert "rollingUpdate" not in sts["spec"].get("updateStrategy", {})  # no maxUnavailable above 1, no partition


def test_kubernetes_fleet_etcd_is_three_members_that_know_each_other(tmp_path: Path) -> None:
    docs = manifests(K8S_FLEET)
    sets = of_kind(docs, "StatefulSet")
    (name,) = [n for n, d in sets.items() if ETCD_IMAGE.fullmatch(image_of(d))]
    sts = sets[name]
    assert sts["spec"]["replicas"] == 3
    service = sts["spec"]["serviceName"]
    assert docs[("Service", service)]["spec"]["publishNotReadyAddresses"]  # peers resolve before they are ready
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    peers = {f"{name}-{i}": f"http://{name}-{i}.{service}:2380" for i in range(3)}
    for i in range(3):
        env = pod_env(container, f"{name}-{i}")
        flags = dict(a.removeprefix("--").split("=", 1) for a in (expand(a, env) for a in container["args"]))
        assert flags["initial-cluster"] == ",".join(f"{m}={url}" for m, url in peers.items())
        assert flags["name"] == f"{name}-{i}" and flags["initial-advertise-peer-urls"] == peers[flags["name"]]
        assert flags["advertise-client-urls"] == f"http://{name}-{i}.{service}:2379"
        assert flags["initial-cluster-state"] == "new"
    nodes, node_sts = node_set(docs)  # the nodes name every member (F15: they move to the next when one is lost)
    _, s = k8s_settings(docs, node_sts["spec"]["template"]["spec"], f"{nodes}-0", tmp_path)
    assert {pod_of(e.host, docs) for e in parse_endpoints(s.fleet.etcd)} == {(name, i) for i in range(3)}
    assert budget_of(docs, sts["spec"]["template"]["metadata"]["labels"])["spec"]["maxUnavailable"] == 1  # quorum


def test_kubernetes_fleet_redis_is_a_cluster_of_six_made_by_a_job() -> None:
    docs = manifests(K8S_FLEET)
    sets = of_kind(docs, "StatefulSet")
    (name,) = [n for n, d in sets.items() if image_of(d).startswith("redis:")]
    sts = sets[name]
    replicas = sts["spec"]["replicas"]
    assert replicas == 6
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    assert re.fullmatch(r"redis:7(\.\d+)*", container["image"])
    config_volume = next(v for v in sts["spec"]["template"]["spec"]["volumes"] if "configMap" in v)
    conf = docs[("ConfigMap", config_volume["configMap"]["name"])]["data"]["redis.conf"]
    assert re.search(r"^cluster-enabled yes$", conf, re.M)
    conf_file = re.search(r"^cluster-config-file (\S+)$", conf, re.M)
    (claim,) = sts["spec"]["volumeClaimTemplates"]  # a restarted member keeps its place in the cluster
    kept = [m["mountPath"] for m in container["volumeMounts"] if m["name"] == claim["metadata"]["name"]]
    assert conf_file and under(conf_file.group(1), kept)
    for pod in (f"{name}-{i}" for i in range(replicas)):
        expand(" ".join(container["command"]), pod_env(container, pod))
    (job,) = of_kind(docs, "Job").values()
    script = job["spec"]["template"]["spec"]["containers"][0]["command"][-1]
    loop = re.search(r"for i in ([\d ]+); do", script)
    assert loop and loop.group(1).split() == [str(i) for i in range(replicas)]
    assert f"{name}-$i.{sts['spec']['serviceName']}" in script
    assert "--cluster-replicas 1" in script
    assert budget_of(docs, sts["spec"]["template"]["metadata"]["labels"])["spec"]["maxUnavailable"] == 1


def test_kubernetes_gateway_file_uses_the_fleet_files_config_and_secrets() -> None:
    """Checked whether or not the CLI has `kvstore gateway` yet: the file parses and names what exists."""
    gateway = manifests(K8S_GATEWAY)
    docs = manifests(K8S_FLEET, K8S_GATEWAY)
    (deployment,) = of_kind(gateway, "Deployment").values()
    pod_spec = deployment["spec"]["template"]["spec"]
    assert pod_spec["containers"][0]["args"][0] == "gateway"
    for v in pod_spec["volumes"]:
        if "secret" in v:
            assert ("Secret", v["secret"]["secretName"]) in docs
        if "configMap" in v:
            assert ("ConfigMap", v["configMap"]["name"]) in docs
        assert "persistentVolumeClaim" not in v  # stateless
    assert deployment["spec"]["replicas"] >= 2


@needs_gateway
def test_kubernetes_gateways_are_a_stateless_deployment_on_the_fleet(tmp_path: Path) -> None:
    docs = manifests(K8S_FLEET, K8S_GATEWAY)
    (name, deployment), = of_kind(manifests(K8S_GATEWAY), "Deployment").items()
    pod_spec = deployment["spec"]["template"]["spec"]
    args, s = k8s_settings(docs, pod_spec, f"{name}-0", tmp_path)
    assert args.command == "gateway"
    (service,) = [n for n, d in of_kind(manifests(K8S_GATEWAY), "Service").items()
                  if d["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()]
    check_k8s_server(docs, pod_spec, s, service, stores=False)
    assert s.fleet.enabled
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
