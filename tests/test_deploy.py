"""The compose stack's configuration, checked with the real tools: docker-compose, promtool, a shell.

No Docker engine is needed: `docker-compose config` resolves and validates the file without one, and the
health-check commands run here in a shell against a local HTTP server. What these tests cannot show is the
stack running; see docs/usage.md.
"""

from __future__ import annotations

import http.server
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, ClassVar
from unittest import mock

import pytest
import yaml

from worker import sample_producer
from worker.cli import EXTERNAL_COMMANDS, build_parser
from worker.config import ENV_PREFIX, WorkerSettings

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
GRAFANA_DATASOURCES = ROOT / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
GRAFANA_DASHBOARD_PROVIDERS = ROOT / "deploy" / "grafana" / "provisioning" / "dashboards" / "score-worker.yml"
DOCKERFILE = ROOT / "Dockerfile"

WORKER_IMAGES = {"cpu": "score-worker:local", "gpu": "score-worker:cuda"}
# Read by the command line itself, before any subcommand: every score-worker container may set them.
CLI_ENV_VARS = {f"{ENV_PREFIX}LOG_LEVEL", f"{ENV_PREFIX}LOG_FORMAT"}
WORKER_ENV_VARS = {f"{ENV_PREFIX}{name.upper()}" for name in WorkerSettings.model_fields} | CLI_ENV_VARS
DEFAULT_METRICS_PORT = WorkerSettings.model_fields["metrics_port"].default
PROMETHEUS_DEFAULT_PORT = 9090
GRAFANA_DEFAULT_PORT = 3000


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        reason = (
            f"{name} is not installed; on Debian or Ubuntu: apt-get install docker-compose prometheus "
            f"(promtool comes with prometheus)"
        )
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return path


@dataclass(frozen=True)
class Stack:
    """`docker-compose config` of one profile selection, and the services that selection starts."""

    profiles: frozenset[str]
    config: dict[str, Any]

    @property
    def services(self) -> dict[str, dict[str, Any]]:
        """The enabled services: no profile, or one of the active ones (compose v2 lists only these)."""
        every: dict[str, dict[str, Any]] = self.config["services"]
        return {
            name: service
            for name, service in every.items()
            if not service.get("profiles") or self.profiles & set(service["profiles"])
        }

    def workers(self) -> dict[str, dict[str, Any]]:
        return {name: s for name, s in self.services.items() if _command(s)[:1] == ["run"]}

    def by_command(self, command: str) -> tuple[str, dict[str, Any]]:
        found = [(name, s) for name, s in self.services.items() if _command(s)[:1] == [command]]
        assert len(found) == 1, f"expected one service running `score-worker {command}`, got {found}"
        return found[0]


def _dotenv() -> dict[str, str]:
    values = {}
    for line in (ROOT / ".env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


@pytest.fixture(scope="module", params=["default", "gpu"], ids=["default-env", "profile-gpu"])
def stack(request: pytest.FixtureRequest) -> Stack:
    """The stack as `docker compose up` would start it: with .env's profile, or COMPOSE_PROFILES=gpu."""
    docker_compose = _tool("docker-compose")
    # Only what the tool needs: variables of the developer's shell must not change what is checked.
    env = {key: os.environ[key] for key in ("PATH", "HOME", "LANG") if key in os.environ}
    if request.param == "gpu":
        env["COMPOSE_PROFILES"] = "gpu"
    proc = subprocess.run(
        [docker_compose, "-f", str(COMPOSE_FILE), "config"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    active = env.get("COMPOSE_PROFILES") or _dotenv().get("COMPOSE_PROFILES", "")
    return Stack(frozenset(p for p in active.split(",") if p), yaml.safe_load(proc.stdout))


def _command(service: Mapping[str, Any]) -> list[str]:
    command = service.get("command") or []
    return command.split() if isinstance(command, str) else [str(part) for part in command]


def _environment(service: Mapping[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    return {str(key): "" if value is None else str(value) for key, value in env.items()}


def _is_score_worker_image(service: Mapping[str, Any]) -> bool:
    return str(service.get("image", "")).startswith("score-worker:")


def _parse_command(service: Mapping[str, Any]) -> Any:
    """The service's command line as `score-worker` parses it, under the service's environment."""
    argv = _command(service)
    with mock.patch.dict(os.environ, _environment(service), clear=True):
        return build_parser(argv).parse_args(argv)


def _bind_mounts(service: Mapping[str, Any]) -> dict[str, Path]:
    """Container path -> host path of each bind mount (named volumes left out)."""
    mounts = {}
    for volume in service.get("volumes") or []:
        if isinstance(volume, str):
            source, _, rest = volume.partition(":")
            target = rest.split(":")[0]
            if source.startswith(("/", ".")):
                mounts[target] = Path(source)
        elif volume.get("type") == "bind":
            mounts[volume["target"]] = Path(volume["source"])
    return mounts


def _host_path(service: Mapping[str, Any], container_path: str) -> Path:
    """Where a path inside the container comes from on the host, through the service's bind mounts."""
    path = PurePosixPath(container_path)
    for target, source in _bind_mounts(service).items():
        if path == PurePosixPath(target) or PurePosixPath(target) in path.parents:
            return source / path.relative_to(target)
    raise AssertionError(f"{container_path} is not inside any bind mount of the service")


def _port_mappings(service: Mapping[str, Any]) -> set[tuple[int | None, int]]:
    """(host port, container port) of each published port; the host port is None when Docker picks it."""
    mappings: set[tuple[int | None, int]] = set()
    for port in service.get("ports") or []:
        if isinstance(port, dict):
            published = port.get("published")
            mappings.add((int(published) if published else None, int(port["target"])))
        else:
            parts = str(port).split("/")[0].split(":")
            mappings.add((int(parts[-2]) if len(parts) > 1 else None, int(parts[-1])))
    return mappings


def _listeners(value: str) -> dict[str, str]:
    """KAFKA_*LISTENERS as listener name -> host:port."""
    return dict(entry.split("://", 1) for entry in value.split(","))


def _healthcheck_argv(service: Mapping[str, Any]) -> list[str]:
    """The health-check command as the container runs it (CMD-SHELL through sh, with $$ unescaped)."""
    test = [str(part).replace("$$", "$") for part in service["healthcheck"]["test"]]
    if test[0] == "CMD-SHELL":
        return ["sh", "-c", " ".join(test[1:])]
    assert test[0] == "CMD", test
    return test[1:]


def _shell_expand(text: str, env: Mapping[str, str]) -> str:
    """${NAME:-default} and ${NAME} as sh expands them, enough to read the URLs of the health checks."""

    def value(match: re.Match[str]) -> str:
        return env.get(match[1]) or (match[3] or "")

    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(:-([^}]*))?\}", value, text.replace("$$", "$"))


def _urls(text: str) -> list[str]:
    return re.findall(r"https?://[^\s'\"]+", text)


def _healthcheck_urls(service: Mapping[str, Any]) -> list[str]:
    return _urls(_shell_expand(" ".join(map(str, service["healthcheck"]["test"][1:])), _environment(service)))


def _prometheus() -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    return config


def _scrape_job(name: str) -> dict[str, Any]:
    jobs = [job for job in _prometheus()["scrape_configs"] if job["job_name"] == name]
    assert len(jobs) == 1, f"expected one scrape job {name!r}"
    return jobs[0]


def _flag(argv: list[str], name: str) -> str | None:
    for arg in argv:
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
    return None


# (a) the file resolves, under both profile selections


def test_default_profile_is_cpu() -> None:
    assert _dotenv().get("COMPOSE_PROFILES") == "cpu"


def test_compose_config_resolves_with_one_worker_per_profile(stack: Stack) -> None:
    services = stack.services
    for name in ("kafka", "topic-init", "model-init", "prometheus", "grafana"):
        assert name in services
    stack.by_command("produce-samples")
    stack.by_command("lag-exporter")
    workers = stack.workers()
    assert len(workers) == 1, f"profiles {set(stack.profiles)} start workers {sorted(workers)}"
    (worker,) = workers.values()
    profile = "gpu" if "gpu" in stack.profiles else "cpu"
    assert worker["image"] == WORKER_IMAGES[profile]
    assert _environment(worker)[f"{ENV_PREFIX}DEVICE"] == ("cuda" if profile == "gpu" else "cpu")
    # Compose refuses to start a service that depends on one its profiles leave out.
    for name, service in services.items():
        for dependency in service.get("depends_on") or {}:
            assert dependency in services, f"{name} depends on {dependency}, which is not started"


# (b) bind mounts


def test_every_bind_mounted_host_path_exists_in_the_repository(stack: Stack) -> None:
    mounts = [(name, path) for name, s in stack.services.items() for path in _bind_mounts(s).values()]
    assert mounts, "the stack mounts its Prometheus and Grafana configuration from deploy/"
    for name, path in mounts:
        assert path.exists(), f"{name} mounts {path}, which does not exist"
        assert ROOT in path.resolve().parents, f"{name} mounts {path}, outside the repository"


def test_mounted_configuration_reaches_the_paths_the_services_read(stack: Stack) -> None:
    prometheus = stack.services["prometheus"]
    config_file = _flag(_command(prometheus), "--config.file")
    assert config_file is not None
    assert _host_path(prometheus, config_file).resolve() == PROMETHEUS_CONFIG

    grafana = stack.services["grafana"]
    datasources = _host_path(grafana, "/etc/grafana/provisioning/datasources")
    assert (datasources / GRAFANA_DATASOURCES.name).resolve() == GRAFANA_DATASOURCES
    providers_dir = _host_path(grafana, "/etc/grafana/provisioning/dashboards")
    assert (providers_dir / GRAFANA_DASHBOARD_PROVIDERS.name).resolve() == GRAFANA_DASHBOARD_PROVIDERS
    (provider,) = yaml.safe_load(GRAFANA_DASHBOARD_PROVIDERS.read_text())["providers"]
    assert provider["type"] == "file"
    dashboards = _host_path(grafana, provider["options"]["path"])
    assert sorted(dashboards.glob("*.json")), f"no dashboard JSON in {dashboards}"

    home = _environment(grafana).get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    assert home is not None
    home_file = _host_path(grafana, home)
    assert home_file.is_file(), f"the home dashboard {home} is {home_file} on the host, which is missing"
    assert json.loads(home_file.read_text())["uid"] == "score-worker"


# (c) ports


def test_prometheus_finds_every_worker_on_its_metrics_port(stack: Stack) -> None:
    (sd,) = _scrape_job("score-worker")["dns_sd_configs"]
    assert sd["type"] == "A"
    for name, worker in stack.workers().items():
        port = int(_environment(worker).get(f"{ENV_PREFIX}METRICS_PORT", DEFAULT_METRICS_PORT))
        assert port == sd["port"], f"{name} serves metrics on {port}, Prometheus scrapes {sd['port']}"
        aliases = set(worker["networks"]["default"]["aliases"])
        assert set(sd["names"]) <= aliases | {name}, f"{name} is not reachable as {sd['names']}"
        assert [url for url in _healthcheck_urls(worker) if f":{port}/" in url], _healthcheck_urls(worker)
        assert set(_healthcheck_urls(worker)) <= {
            f"http://127.0.0.1:{port}/readyz",
            f"http://127.0.0.1:{port}/healthz",
        }


def test_lag_exporter_port_matches_its_scrape_target_and_the_worker_group(stack: Stack) -> None:
    name, exporter = stack.by_command("lag-exporter")
    args = _parse_command(exporter)
    (static,) = _scrape_job("score-worker-lag")["static_configs"]
    assert static["targets"] == [f"{name}:{args.port}"]
    assert args.port in {target for _, target in _port_mappings(exporter)}
    assert _healthcheck_urls(exporter) == [f"http://127.0.0.1:{args.port}/healthz"]
    groups = set(args.group or args.default_groups)
    for worker in stack.workers().values():
        assert _environment(worker).get(f"{ENV_PREFIX}GROUP_ID", "score-worker") in groups


def test_the_gateway_is_scraped_on_its_port_and_shares_the_workers_topics(stack: Stack) -> None:
    """The gateway serves its metrics on its HTTP port; its calls go to the workers' requests topic, and
    its reply topic (named under the results topic) is one the workers' default pattern allows."""
    from worker.gateway.bridge import default_reply_topic
    from worker.gateway.command import build_settings

    name, gateway = stack.by_command("gateway")
    with mock.patch.dict(os.environ, _environment(gateway), clear=True):
        settings = build_settings(_parse_command(gateway))
    (static,) = _scrape_job("score-gateway")["static_configs"]
    assert static["targets"] == [f"{name}:{settings.gateway_port}"]
    assert settings.gateway_port in {target for _, target in _port_mappings(gateway)}
    assert _healthcheck_urls(gateway) == [f"http://127.0.0.1:{settings.gateway_port}/health"]
    for worker in stack.workers().values():
        env = _environment(worker)
        assert env.get(f"{ENV_PREFIX}REQUESTS_TOPIC") == settings.requests_topic
        assert env.get(f"{ENV_PREFIX}RESULTS_TOPIC") == settings.results_topic
        pattern = WorkerSettings.model_fields["reply_topic_pattern"].default
        assert f"{ENV_PREFIX}REPLY_TOPIC_PATTERN" not in env
        assert re.fullmatch(pattern, default_reply_topic(settings.results_topic))


def test_prometheus_and_grafana_ports_agree(stack: Stack) -> None:
    prometheus = stack.services["prometheus"]
    listen = _flag(_command(prometheus), "--web.listen-address")
    port = int(listen.rsplit(":", 1)[1]) if listen else PROMETHEUS_DEFAULT_PORT
    assert port in {target for _, target in _port_mappings(prometheus)}
    assert _healthcheck_urls(prometheus) == [f"http://localhost:{port}/-/healthy"]
    assert _scrape_job("prometheus")["static_configs"] == [{"targets": [f"localhost:{port}"]}]
    (datasource,) = yaml.safe_load(GRAFANA_DATASOURCES.read_text())["datasources"]
    assert datasource["url"] == f"http://prometheus:{port}"
    assert (datasource["uid"], datasource["name"], datasource["type"]) == (
        "prometheus",
        "Prometheus",
        "prometheus",
    )
    assert datasource["isDefault"] is True

    grafana = stack.services["grafana"]
    grafana_port = int(_environment(grafana).get("GF_SERVER_HTTP_PORT", GRAFANA_DEFAULT_PORT))
    assert grafana_port in {target for _, target in _port_mappings(grafana)}
    assert _healthcheck_urls(grafana) == [f"http://localhost:{grafana_port}/api/health"]


def test_kafka_clients_use_a_listener_the_broker_advertises(stack: Stack) -> None:
    kafka = stack.services["kafka"]
    env = _environment(kafka)
    listeners = _listeners(env["KAFKA_LISTENERS"])
    advertised = _listeners(env["KAFKA_ADVERTISED_LISTENERS"])
    internal = advertised[env["KAFKA_INTER_BROKER_LISTENER_NAME"]]
    assert internal.rsplit(":", 1)[1] == listeners[env["KAFKA_INTER_BROKER_LISTENER_NAME"]].rsplit(":", 1)[1]
    for name, service in stack.services.items():
        bootstrap = _environment(service).get(f"{ENV_PREFIX}BOOTSTRAP_SERVERS")
        if bootstrap is not None:
            assert bootstrap.split(",") == [internal], f"{name} bootstraps from {bootstrap}"
    # The host reaches the HOST listener through the published port it is advertised with.
    host_port = int(advertised["HOST"].rsplit(":", 1)[1])
    assert (host_port, int(listeners["HOST"].rsplit(":", 1)[1])) in _port_mappings(kafka)


def test_the_suite_runs_the_kafka_version_compose_runs(stack: Stack) -> None:
    """The suite's Apache Kafka tiers (deploy/kafka/pom.xml) include the broker image the stack starts."""
    from worker.apache_kafka import pom_versions

    images = {
        service["image"]
        for service in stack.config["services"].values()
        if "kafka" in service.get("image", "")
    }
    assert images == {f"apache/kafka:{pom_versions(ROOT / 'deploy/kafka/pom.xml')['compose']}"}


def test_producer_and_workers_share_the_requests_topic(stack: Stack) -> None:
    _, producer = stack.by_command("produce-samples")
    topic = _parse_command(producer).topic
    for worker in stack.workers().values():
        assert _environment(worker).get(f"{ENV_PREFIX}REQUESTS_TOPIC", "score.requests") == topic


# (d) environment variables


def test_every_environment_variable_is_read_by_its_service(stack: Stack) -> None:
    for name, service in stack.services.items():
        env = set(_environment(service))
        command = _command(service)[:1]
        if _is_score_worker_image(service) and command == ["run"]:
            allowed = WORKER_ENV_VARS
        elif _is_score_worker_image(service) and command and command[0] in EXTERNAL_COMMANDS:
            module = importlib.import_module(EXTERNAL_COMMANDS[command[0]][0])
            allowed = set(module.ENV_VARS) | CLI_ENV_VARS
        else:  # kafka's own tools, or score-worker under a shell: only worker settings may be shared
            allowed = WORKER_ENV_VARS | {v for v in env if not v.startswith("SCORE_")}
        unknown = sorted(v for v in env - allowed if v.startswith("SCORE_"))
        assert not unknown, f"{name} sets {unknown}, which `{' '.join(command)}` does not read"


def test_commands_accept_their_environment(stack: Stack, tmp_path: Path) -> None:
    for name, service in stack.services.items():
        command = _command(service)[:1]
        if not _is_score_worker_image(service) or not command:
            continue
        if command == ["run"]:
            # The model directory is checked for existence; the rest is validated as the worker would.
            with mock.patch.dict(os.environ, _environment(service), clear=True):
                WorkerSettings(model_dir=tmp_path)
        elif command[0] in EXTERNAL_COMMANDS:
            try:
                _parse_command(service)
            except SystemExit as exc:
                raise AssertionError(
                    f"{name}: `score-worker {' '.join(_command(service))}` is refused"
                ) from exc


# (e) promtool


def test_promtool_accepts_the_prometheus_config() -> None:
    promtool = _tool("promtool")
    proc = subprocess.run(
        [promtool, "check", "config", str(PROMETHEUS_CONFIG)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _prometheus()["global"]["scrape_interval"] == "5s"


# (f) GPU reservation, health checks, Dockerfile, licence


def test_only_the_gpu_worker_reserves_a_gpu(stack: Stack) -> None:
    for name, service in stack.services.items():
        devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices")
        if service.get("image") == WORKER_IMAGES["gpu"]:
            assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}], name
            index = service["build"]["args"]["TORCH_INDEX_URL"]
            assert re.search(r"/whl/cu\d+$", index), f"{name} builds with {index}, not a CUDA wheel index"
        else:
            assert not devices, f"{name} reserves {devices}"


def test_every_long_running_service_has_a_healthcheck(stack: Stack) -> None:
    for name, service in stack.services.items():
        if service.get("restart") == "no":  # one-shot set-up; the others wait for it to complete
            continue
        check = service.get("healthcheck")
        assert check and not check.get("disable") and check.get("test"), f"{name} has no healthcheck"


class _StubHealth(http.server.BaseHTTPRequestHandler):
    status: ClassVar[dict[str, int]] = {}

    def do_GET(self) -> None:
        self.send_response(self.status.get(self.path, 404))
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def stub_server() -> Iterator[tuple[int, dict[str, int]]]:
    """A local HTTP server whose answer per path the test sets: the other end of the health checks."""
    status: dict[str, int] = {}
    handler = type("Handler", (_StubHealth,), {"status": status})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], status
    finally:
        server.shutdown()
        server.server_close()


def _run_check(argv: list[str], env: Mapping[str, str]) -> int:
    # `python` in the checks is the image's interpreter; here it is this one.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return subprocess.run(
        argv, env={**env, "PATH": path}, capture_output=True, timeout=30, check=False
    ).returncode


def test_http_healthchecks_pass_on_200_and_fail_otherwise(
    stack: Stack, stub_server: tuple[int, dict[str, int]]
) -> None:
    port, status = stub_server
    port_variable = {
        "run": f"{ENV_PREFIX}METRICS_PORT",
        "lag-exporter": "SCORE_LAG_EXPORTER_PORT",
        "gateway": f"{ENV_PREFIX}GATEWAY_PORT",
    }
    services = [
        *stack.workers().values(),
        stack.by_command("lag-exporter")[1],
        stack.by_command("gateway")[1],
    ]
    for service in services:
        env = {**_environment(service), port_variable[_command(service)[0]]: str(port)}
        argv = _healthcheck_argv(service)
        (url,) = _urls(_shell_expand(" ".join(argv), env))
        path = url.split(f"127.0.0.1:{port}", 1)[1]
        status[path] = 200
        assert _run_check(argv, env) == 0
        status[path] = 503
        assert _run_check(argv, env) != 0
        status.clear()


def test_producer_healthcheck_wants_a_fresh_heartbeat(stack: Stack, tmp_path: Path) -> None:
    _, producer = stack.by_command("produce-samples")
    assert _parse_command(producer).heartbeat_file == Path(sample_producer.DEFAULT_HEARTBEAT_FILE)
    argv = _healthcheck_argv(producer)
    assert sample_producer.DEFAULT_HEARTBEAT_FILE in " ".join(argv)
    heartbeat = tmp_path / "alive"
    argv = [part.replace(sample_producer.DEFAULT_HEARTBEAT_FILE, str(heartbeat)) for part in argv]
    assert _run_check(argv, {}) != 0  # not yet written
    heartbeat.touch()
    assert _run_check(argv, {}) == 0
    stale = time.time() - 60
    os.utime(heartbeat, (stale, stale))
    assert _run_check(argv, {}) != 0


def _dockerfile_instructions() -> list[tuple[str, str]]:
    lines = [line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    instructions = []
    for line in joined.splitlines():
        if line.strip():
            keyword, _, rest = line.strip().partition(" ")
            instructions.append((keyword.upper(), rest.strip()))
    return instructions


def test_dockerfile_runs_unprivileged_with_a_healthcheck(stub_server: tuple[int, dict[str, int]]) -> None:
    instructions = _dockerfile_instructions()
    users = [rest for keyword, rest in instructions if keyword == "USER"]
    assert users and users[-1].split(":")[0] not in {"root", "0"}
    exposed = {port for keyword, rest in instructions if keyword == "EXPOSE" for port in rest.split()}
    assert {str(DEFAULT_METRICS_PORT), "9465"} <= exposed

    (check,) = [rest for keyword, rest in instructions if keyword == "HEALTHCHECK"]
    command = check.split(" CMD ", 1)[1].strip()
    assert not command.startswith("["), "the shell form is needed for ${SCORE_WORKER_METRICS_PORT:-9464}"
    port, status = stub_server
    env = {f"{ENV_PREFIX}METRICS_PORT": str(port)}
    status["/healthz"] = 200
    assert _run_check(["sh", "-c", command], env) == 0
    status["/healthz"] = 503
    assert _run_check(["sh", "-c", command], env) != 0
    assert _run_check(["sh", "-c", command], {f"{ENV_PREFIX}METRICS_PORT": "0"}) == 0  # no HTTP to ask


def test_the_image_build_gets_every_file_it_copies() -> None:
    copied = {
        source.rstrip("/")
        for keyword, rest in _dockerfile_instructions()
        if keyword == "COPY"
        for source in rest.split()[:-1]
        if not source.startswith("--")
    }
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # setuptools refuses to build when a license-files pattern matches nothing.
    assert set(pyproject.get("license-files", [])) <= copied
    ignored = {
        line.strip().rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    for source in copied:
        assert (ROOT / source).exists(), source
        assert source not in ignored, f".dockerignore leaves {source} out of the build context"


def test_the_image_installs_the_pinned_versions_the_suite_ran_with() -> None:
    """Every pip install of the image takes constraints.txt, which pins the codec library (cramjam) and
    torch's build-independent version, as ./dev.sh does."""
    installs = [
        rest for keyword, rest in _dockerfile_instructions() if keyword == "RUN" and "pip install" in rest
    ]
    assert installs and all("-c constraints.txt" in rest for rest in installs), installs
    pins = {
        line.split("==")[0].lower(): line.split("==")[1]
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    }
    assert {"torch", "transformers", "aiokafka", "cramjam", "numpy"} <= pins.keys()
    assert pins["torch"] == re.search(r"TORCH_VERSION=(\S+)", DOCKERFILE.read_text()).group(1)  # type: ignore[union-attr]
    assert f"TORCH_VERSION={pins['torch']}" in (ROOT / "dev.sh").read_text()


def test_license_is_the_apache_license_2() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n                           Version 2.0, January 2004")
    for clause in ("TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION", "9. Accepting Warranty"):
        assert clause in text
    assert "END OF TERMS AND CONDITIONS" in text
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert pyproject["license"] == "Apache-2.0"
    assert pyproject["license-files"] == ["LICENSE"]
