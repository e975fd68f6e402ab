"""Every deploy file parses, and each `kvstore` command, flag, setting and variable it uses exists
(issue 12 item 6): a renamed flag or setting fails here, not on an operator's node.

Commands are parsed by the real `kvstore.cli.build_parser`; TOML files (on their own and
as a ConfigMap holds one) are loaded by `kvstore.config.load_settings` with the variables
the file sets, so an unknown setting or a value out of range is refused as `kvstore serve`
would refuse it; each `KVSTORE_<SECTION>_<FIELD>` is checked against the config's
dataclasses (load_settings ignores an unknown section). Beyond names, what the files
promise each other: the stop timeout beyond `server.grace_s`, the data dir writable, the
ports and every file a setting names mounted, auth and TLS on.
"""

from __future__ import annotations

import configparser
import dataclasses
import re
import shlex
import typing
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from kvstore.cli import build_parser
from kvstore.config import Settings, load_settings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
#: Variables a deploy file may set that are not settings.
NON_SETTING_VARIABLES = {"KVSTORE_CONFIG", "KVSTORE_TOKEN"}
DEPLOY_FILES = {"README.md", "kvstore.toml", "kvstore-redis-cluster.toml", "kvstore.service", "docker/Dockerfile",
                "docker/Dockerfile.dockerignore", "docker/compose.yaml", "docker/kvstore.toml",
                "docker/compose-fleet.yaml", "docker/kvstore-fleet.toml", "docker/make-test-certs.sh",
                "k8s/kvstore.yaml", "k8s/kvstore-fleet.yaml", "k8s/kvstore-gateway.yaml",
                "grafana/kvstore-dashboard.json"}
#: Where deploy/README.md has an operator make certificates and tokens: theirs, not the project's files.
MADE_HERE = DEPLOY / "docker" / "certs"


def test_every_deploy_file_is_checked_here() -> None:
    found = {str(p.relative_to(DEPLOY)) for p in DEPLOY.rglob("*") if p.is_file() and not p.is_relative_to(MADE_HERE)}
    # The fleet's files: tests/deploy/test_deploy_fleet.py; the dashboard: tests/gateway/metrics/test_dashboard.py.
    assert found == DEPLOY_FILES


def kvstore_command(argv: list[str]) -> Any:
    """Parse `kvstore ...` as the CLI would; fail naming the command when it does not parse."""
    assert argv[0] == "kvstore", argv
    try:
        return build_parser(argv[1:]).parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"`{shlex.join(argv)}` does not parse")


def check_variables(env: dict[str, str]) -> None:
    """Each KVSTORE_<SECTION>_<FIELD> names a setting of kvstore.config."""
    sections = typing.get_type_hints(Settings)
    for name in env:
        if not name.startswith("KVSTORE_") or name in NON_SETTING_VARIABLES:
            continue
        matches = [(s, name[len(f"KVSTORE_{s.upper()}_"):].lower()) for s in sections
                   if name.startswith(f"KVSTORE_{s.upper()}_")]
        assert matches, f"{name}: no such section in kvstore.config"
        section, field = matches[0]
        assert field in {f.name for f in dataclasses.fields(sections[section])}, f"{name}: no setting {section}.{field}"


def settings_of(toml: Path, env: dict[str, str] | None = None) -> Settings:
    env = {k: str(v) for k, v in (env or {}).items()}
    check_variables(env)
    return load_settings(toml, environ=env)


def path_settings(s: Settings) -> list[str]:
    """Every file or folder the settings name."""
    paths = [str(s.store.data_dir), s.tls.cert_file, s.tls.key_file, s.tls.client_ca_file, s.auth.tenants_file,
             s.fleet.token_file, s.fleet.ca_file]
    return [p for p in paths if p]


def under(path: str, mounts: list[str]) -> bool:
    return any(PurePosixPath(path).is_relative_to(m) for m in mounts)


def assert_secured(s: Settings) -> None:
    """Beyond loopback: tokens and TLS on (the server refuses to start otherwise)."""
    assert s.server.host not in ("127.0.0.1", "localhost", "::1")
    assert s.auth.required and not s.auth.insecure
    assert s.tls.enabled


def dockerfile_env() -> dict[str, str]:
    text = (DEPLOY / "docker" / "Dockerfile").read_text()
    return {m.group(1): m.group(2) for m in re.finditer(r"^ENV (\w+)=(\S+)$", text, re.M)}


def dockerfile_entrypoint() -> list[str]:
    text = (DEPLOY / "docker" / "Dockerfile").read_text()
    entrypoint = re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M)
    cmd = re.search(r"^CMD (\[.*\])$", text, re.M)
    assert entrypoint and cmd
    kvstore_command(yaml.safe_load(entrypoint.group(1)) + yaml.safe_load(cmd.group(1)))
    return list(yaml.safe_load(entrypoint.group(1)))


# -- TOML --


@pytest.mark.parametrize("name", ["kvstore.toml", "kvstore-redis-cluster.toml", "docker/kvstore.toml"])
def test_toml_files_load_and_turn_auth_and_tls_on(name: str) -> None:
    s = settings_of(DEPLOY / name)
    assert_secured(s)


def test_the_reference_toml_names_every_setting() -> None:
    """deploy/kvstore.toml shows every setting (commented out at most), so a new one gets documented."""
    text = (DEPLOY / "kvstore.toml").read_text()
    for section, cls in typing.get_type_hints(Settings).items():
        parts = re.split(rf"^\[{section}\]$", text, flags=re.M)
        assert len(parts) == 2, f"deploy/kvstore.toml has no [{section}]"
        body = parts[1].split("\n[", 1)[0]
        for f in dataclasses.fields(cls):
            assert re.search(rf"^#? ?{f.name} = ", body, re.M), f"deploy/kvstore.toml lacks {section}.{f.name}"


# -- systemd --


def unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # systemd keys are case-sensitive
    parser.read(DEPLOY / "kvstore.service")
    return parser


def test_systemd_unit_runs_a_real_command_hardened() -> None:
    service = unit()["Service"]
    argv = shlex.split(service["ExecStart"])
    assert Path(argv[0]).name == "kvstore"
    args = kvstore_command(["kvstore", *argv[1:]])
    installed = re.search(r"install .* deploy/(\S+) (\S+)", (DEPLOY / "kvstore.service").read_text())
    assert installed and installed.group(2) == str(args.config)  # the file the install line puts there
    s = settings_of(DEPLOY / installed.group(1), dict(
        line.split("=", 1) for line in service.get("Environment", "").split() if "=" in line))
    assert_secured(s)
    assert float(service["TimeoutStopSec"]) > s.server.grace_s
    assert service["KillSignal"] == "SIGTERM" and service["Restart"] == "on-failure"
    assert service["User"] not in ("", "root") and service["NoNewPrivileges"] == "yes"
    assert service["ProtectSystem"] == "strict"
    assert under(str(s.store.data_dir), service["ReadWritePaths"].split())
    assert f"/var/lib/{service['StateDirectory']}" == str(s.store.data_dir)
    assert int(service["LimitNOFILE"]) >= 65536


# -- docker compose --


def compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((DEPLOY / "docker" / "compose.yaml").read_text())
    return doc


def test_compose_runs_kvstore_with_redis_secured() -> None:
    services = compose()["services"]
    kv = services["kvstore"]
    args = kvstore_command(dockerfile_entrypoint() + kv["command"])
    binds = {v.split(":")[1]: v.split(":")[0] for v in kv["volumes"]}
    config = (DEPLOY / "docker" / binds[str(args.config)]).resolve()  # the file mounted where --config looks
    s = settings_of(config, kv["environment"])
    assert_secured(s)
    # `docker compose exec kvstore kvstore tenant create` finds the server's config, so its tenants file.
    assert (dockerfile_env() | kv["environment"])["KVSTORE_CONFIG"] == str(args.config)
    assert s.swa.backend == "redis" and s.swa.redis_url.startswith("redis://redis:")
    assert "redis" in services and "redis" in kv["depends_on"]
    for path in path_settings(s):
        assert under(path, list(binds)), f"{path} is not mounted into the container"
    published = {int(str(p).rsplit(":", 1)[1]) for p in kv["ports"]}
    assert {s.server.port, s.metrics.port} <= published
    assert _seconds(kv["stop_grace_period"]) > s.server.grace_s
    health = kv["healthcheck"]["test"]
    assert health[0] == "CMD"
    probe = kvstore_command(health[1:])
    assert under(probe.tls_ca, list(binds))
    assert probe.target.endswith(f":{s.server.port}")


def _seconds(text: str) -> float:
    match = re.fullmatch(r"(\d+)(s|m)", text)
    assert match, text
    return float(match.group(1)) * (60 if match.group(2) == "m" else 1)


# -- Kubernetes --


def manifests() -> dict[tuple[str, str], dict[str, Any]]:
    docs = yaml.safe_load_all((DEPLOY / "k8s" / "kvstore.yaml").read_text())
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def test_kubernetes_statefulset_on_local_nvme_secured(tmp_path: Path) -> None:
    docs = manifests()
    sts = docs[("StatefulSet", "kvstore")]
    pod = sts["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = kvstore_command(dockerfile_entrypoint() + container["args"])
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    config_mount = mounts[str(args.config)]
    volume = next(v for v in pod["volumes"] if v["name"] == config_mount["name"])
    toml_text = docs[("ConfigMap", volume["configMap"]["name"])]["data"][config_mount["subPath"]]
    toml = tmp_path / "kvstore.toml"
    toml.write_text(toml_text)
    s = settings_of(toml, {e["name"]: e["value"] for e in container.get("env", [])})
    assert_secured(s)
    for path in path_settings(s):
        assert under(path, list(mounts)), f"{path} is not mounted into the pod"
    for v in pod["volumes"]:  # every Secret named is in the file
        if "secret" in v:
            assert ("Secret", v["secret"]["secretName"]) in docs
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (ports["grpc"], ports["metrics"]) == (s.server.port, s.metrics.port)
    service = docs[("Service", sts["spec"]["serviceName"])]
    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(ports)
    assert pod["terminationGracePeriodSeconds"] > s.server.grace_s
    for kind in ("startupProbe", "readinessProbe"):
        probe = kvstore_command(container[kind]["exec"]["command"])
        assert under(probe.tls_ca, list(mounts)) and probe.target.endswith(f":{s.server.port}")
    assert container["resources"]["limits"]["memory"]
    # Local NVMe: the claim template's class binds on scheduling, to the data dir's mount.
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert mounts[str(s.store.data_dir)]["name"] == claim["metadata"]["name"]
    storage_class = docs[("StorageClass", claim["spec"]["storageClassName"])]
    assert storage_class["volumeBindingMode"] == "WaitForFirstConsumer"
    assert any(d["kind"] == "PersistentVolume" and "local" in d["spec"] for d in docs.values())
    assert pod["securityContext"]["runAsNonRoot"] and not container["securityContext"]["allowPrivilegeEscalation"]


# -- the docs --


#: The files whose settings deploy/README.md explains (the two reference TOMLs explain theirs in comments).
EXPLAINED_IN_README = ("kvstore.service", "docker/compose.yaml", "docker/kvstore.toml", "k8s/kvstore.yaml",
                       "docker/compose-fleet.yaml", "docker/kvstore-fleet.toml", "k8s/kvstore-fleet.yaml",
                       "k8s/kvstore-gateway.yaml")


def test_deploy_readme_explains_every_setting_the_files_set() -> None:
    readme = (DEPLOY / "README.md").read_text()
    text = "\n".join((DEPLOY / f).read_text() for f in EXPLAINED_IN_README)
    set_here = set(re.findall(r"^\s*([a-z_]+) = ", text, re.M))  # TOML keys
    set_here |= {m.lower() for m in re.findall(r"KVSTORE_[A-Z]+_([A-Z_]+)", text)}
    fields = {f.name for cls in typing.get_type_hints(Settings).values() for f in dataclasses.fields(cls)}
    for name in sorted(set_here & fields):
        explained = f"`{name}`" in readme or re.search(rf"`\w+\.{name}`", readme)
        assert explained, f"deploy/README.md does not explain {name}"
