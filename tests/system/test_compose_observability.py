"""compose.yaml's `observability` profile as Compose merges it (`tests.support.compose`, as
test_compose.py reads the file): off by default, on with `--profile observability` or
ops/observability.env; Prometheus, Grafana, Jaeger and redis_exporter bound to loopback;
every file they mount is in the repository and says what the services are (Prometheus
scrapes the ports the orchestrator and Flower listen on, with the rules, exemplars on;
Grafana's datasources name the profile's services and its board is where the provider
reads); the rlship services trace only when the OTEL_* variables are set, and then to Jaeger."""

from __future__ import annotations

import subprocess
from pathlib import PurePosixPath
from urllib.parse import urlsplit

import yaml

from tests.support.compose import compose, container_argv, env_file
from tests.support.observability import board, promtool
from tests.support.processes import REPO

PROFILE = {"prometheus", "grafana", "jaeger", "redis-exporter"}
OBSERVABILITY_ENV = REPO / "ops" / "observability.env"
OTEL = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_HEADERS")
# No variable set: no endpoint (tracing off), and the SDK's own defaults for the rest.
UNSET = {
    "OTEL_EXPORTER_OTLP_ENDPOINT": "",
    "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
    "OTEL_EXPORTER_OTLP_HEADERS": "",
}


def rlship_services(services: dict) -> dict:
    return {name: service for name, service in services.items() if "build" in service}


def mounts(service: dict) -> dict[str, str]:
    """A service's bind mounts of repository paths: container path -> repository path."""
    found = {}
    for volume in service.get("volumes", []):
        source, target, *_ = volume.split(":")
        if source.startswith("./"):
            found[target] = source[2:]
    return found


def repo_file(service: dict, container_path: str):
    """The repository file a service sees at `container_path` through its bind mounts."""
    path = PurePosixPath(container_path)
    for target, source in mounts(service).items():
        if path.is_relative_to(target):
            return REPO / source / path.relative_to(target)
    raise AssertionError(f"{container_path} is not mounted from the repository")


def test_the_profile_is_off_by_default_and_tracing_with_it() -> None:
    services = compose()["services"]
    assert not PROFILE & set(services)
    for name, service in rlship_services(services).items():
        tracing = {variable: service["environment"][variable] for variable in OTEL}
        assert tracing == UNSET, name
    # `--profile observability` alone starts the services; tracing needs the endpoint set.
    profiled = compose(profiles=("observability",))["services"]
    assert set(profiled) >= PROFILE
    for service in rlship_services(profiled).values():
        assert service["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == ""


def test_the_env_file_turns_on_the_profile_and_sends_every_service_to_jaeger() -> None:
    env = env_file(OBSERVABILITY_ENV, {"RLSHIP_RUN_ID": "r1"})
    services = compose(env)["services"]
    assert set(services) >= PROFILE
    assert services["orchestrator"]["environment"]["RLSHIP_RUN_ID"] == "r1"  # the shell still wins
    jaeger_ports = {int(port.rsplit(":", 1)[1]) for port in services["jaeger"]["ports"]}
    protocol_port = {"http/protobuf": 4318, "http/json": 4318, "grpc": 4317}
    for name, service in rlship_services(services).items():
        environment = service["environment"]
        endpoint = urlsplit(environment["OTEL_EXPORTER_OTLP_ENDPOINT"])
        assert endpoint.hostname == "jaeger" and endpoint.port in jaeger_ports, name
        assert endpoint.port == protocol_port[environment["OTEL_EXPORTER_OTLP_PROTOCOL"]], name
    assert services["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"


def test_profile_services_are_pinned_on_loopback_and_wait_for_health() -> None:
    services = compose(profiles=("observability",))["services"]
    for name in PROFILE:
        service = services[name]
        tag = service["image"].partition(":")[2]
        assert tag and tag != "latest", f"{name}: pin the image's version"
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
        for dependency, condition in service.get("depends_on", {}).items():
            assert dependency in services, name
            if condition["condition"] == "service_healthy":
                assert "healthcheck" in services[dependency], f"{name} waits for {dependency}'s health"
        for source in mounts(service).values():
            assert (REPO / source).exists(), f"{name} mounts ./{source}, not in the repository"


def test_prometheus_scrapes_the_services_with_the_rules_and_exemplars() -> None:
    services = compose(profiles=("observability",))["services"]
    prometheus = services["prometheus"]
    options = dict(token[2:].split("=", 1) for token in prometheus["command"] if "=" in token)
    assert "exemplar-storage" in options["enable-feature"].split(",")
    config_path = repo_file(prometheus, options["config.file"])
    assert config_path == REPO / "ops" / "prometheus" / "prometheus.yml"
    checked = subprocess.run(
        [promtool(), "check", "config", str(config_path)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0 and "rlship-alerts.yml" in checked.stdout, checked.stdout + checked.stderr
    config = yaml.safe_load(config_path.read_text())
    targets = {
        job["job_name"]: [target for static in job["static_configs"] for target in static["targets"]]
        for job in config["scrape_configs"]
    }
    orchestrator = services["orchestrator"]["environment"]
    assert orchestrator["RLSHIP_METRICS_HOST"] == "0.0.0.0"
    assert targets["rlship"] == [f"orchestrator:{orchestrator['RLSHIP_METRICS_PORT']}"]
    flower = dict(t[2:].split("=", 1) for t in container_argv(services["flower"]["command"]) if "=" in t)
    assert targets["flower"] == [f"flower:{flower['port']}"]
    for job, hosts in targets.items():
        for target in hosts:
            assert target.split(":")[0] in services, f"{job} scrapes {target}: no such service"


def test_grafana_is_provisioned_from_the_repository() -> None:
    services = compose(profiles=("observability",))["services"]
    grafana = services["grafana"]
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    provisioning = repo_file(grafana, "/etc/grafana/provisioning")
    datasources = {
        source["uid"]: source
        for path in (provisioning / "datasources").glob("*.yml")
        for source in yaml.safe_load(path.read_text())["datasources"]
    }
    by_type = {source["type"]: source for source in datasources.values()}
    assert urlsplit(by_type["prometheus"]["url"]).netloc == "prometheus:9090"
    assert urlsplit(by_type["jaeger"]["url"]).netloc == "jaeger:16686"
    assert any(port.endswith(":16686") for port in services["jaeger"]["ports"])
    (destination,) = by_type["prometheus"]["jsonData"]["exemplarTraceIdDestinations"]
    assert destination == {"name": "trace_id", "datasourceUid": by_type["jaeger"]["uid"]}
    (provider,) = [
        provider
        for path in (provisioning / "dashboards").glob("*.yml")
        for provider in yaml.safe_load(path.read_text())["providers"]
    ]
    board_dir = repo_file(grafana, provider["options"]["path"])
    assert (board_dir / "rlship-step.json").is_file()
    assert repo_file(grafana, grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]).is_file()
    used = {panel["datasource"]["uid"] for panel in board()["panels"] if "datasource" in panel}
    assert used <= set(datasources), "the board names a datasource Grafana is not given"
