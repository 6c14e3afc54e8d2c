"""docker-compose.yml, .env.example and the Dockerfile.

The checks:
- ``docker-compose config`` accepts the file, with .env.example as its env file.
- The file's structure: profiles, required secrets, scaling, shutdown, and full coverage of
  the settings; the monitoring profile's Prometheus and Grafana files it mounts.
- The run check: every app service's own entrypoint, command, environment and healthchecks
  are read from the file and run as local processes, with the container's names mapped to
  the tests' services: their Redis DB, a fresh PostgreSQL, the simulator started from the
  ``sim`` service's command, and a temp copy of the prompts folder. A small job then has
  to complete through them, and each worker's /metrics, as Prometheus scrapes it, has to
  count what SQL holds.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
import requests
import sqlalchemy as sa
import yaml
from prometheus_client.parser import text_string_to_metric_families

from common.ledger import Ledger
from common.schema import results
from common.settings import ENV_PREFIX, Settings
from common.store import Store
from ops import healthcheck
from tests.conftest import POSTGRES_URL, REDIS_URL, ROOT, _fresh_postgres
from tests.helpers import assert_invariants, wait_settled

COMPOSE_FILE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
VENV_BIN = Path(sys.executable).parent
APP_SERVICES = ("worker", "producer", "flower", "sim")
SECRETS = ("REDIS_PASSWORD", "POSTGRES_PASSWORD", "FLOWER_USER", "FLOWER_PASSWORD",
           "GRAFANA_PASSWORD")
MONITORING = ROOT / "monitoring"
# What a user would put in .env, with the simulator made fast for a test.
TEST_ENV = {
    "REDIS_PASSWORD": "test-redis-pw",
    "POSTGRES_PASSWORD": "test-pg-pw",
    "FLOWER_USER": "tester",
    "FLOWER_PASSWORD": "test-flower-pw",
    "DATAGEN_CONCURRENCY": "8",
    "SIM_DECODE_TOK_PER_S": "3000",
    "SGLANG_WAIT_S": "30",
}
PROMPTS_PER_FILE = 12


# -- reading the compose file as Compose does ---------------------------------------------------


class MissingVariable(Exception):
    pass


_VAR = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<braced>[^}]*)\}|(?P<named>[A-Za-z_]\w*))")
_BRACED = re.compile(r"(?P<name>[A-Za-z_]\w*)(?:(?P<op>:-|-|:\?|\?)(?P<arg>.*))?", re.S)


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """Compose's ``$VAR``, ``${VAR}``, ``${VAR:-default}``, ``${VAR:?error}`` and ``$$``."""

    def one(m: re.Match[str]) -> str:
        if m["escaped"]:
            return "$"
        if m["named"]:
            return env.get(m["named"], "")
        b = _BRACED.fullmatch(m["braced"])
        assert b, f"unsupported interpolation ${{{m['braced']}}}"
        value, op, arg = env.get(b["name"]), b["op"], b["arg"]
        if op in (":?", "?") and (value is None or (op == ":?" and value == "")):
            raise MissingVariable(f"{b['name']}: {arg}")
        if op == ":-":
            return value or arg
        if op == "-":
            return arg if value is None else value
        return value or ""

    return _VAR.sub(one, text)


def _interpolated(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, dict):
        return {k: _interpolated(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [_interpolated(v, env) for v in node]
    return node


def read_env_file(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f"{path.name}: not KEY=VALUE: {line!r}"
            env[key.strip()] = value
    return env


def compose_env(**overrides: str) -> dict[str, str]:
    return {**read_env_file(ENV_EXAMPLE), **TEST_ENV, **overrides}


def load_compose(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    raw = yaml.safe_load(COMPOSE_FILE.read_text())  # resolves the anchors and << merges
    return raw if env is None else _interpolated(raw, env)


def argv_of(value: str | list[str] | None) -> list[str]:
    if value is None:
        return []
    return shlex.split(value) if isinstance(value, str) else [str(v) for v in value]


def healthcheck_argv(service: dict[str, Any]) -> list[str]:
    test = service["healthcheck"]["test"]
    if isinstance(test, str):
        return ["sh", "-c", test]
    if test[0] == "CMD-SHELL":
        return ["sh", "-c", test[1]]
    assert test[0] == "CMD", test
    return list(test[1:])


def seconds(duration: str) -> float:
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", duration)
    assert parts and duration, f"unsupported duration {duration!r}"
    h, m, s = (int(x or 0) for x in parts.groups())
    return h * 3600 + m * 60 + s


def setting_env_names() -> list[str]:
    return [
        ENV_PREFIX + ("SGLANG_URL" if f.name == "sglang_urls" else f.name.upper())
        for f in dataclasses.fields(Settings)
    ]


# -- (a) docker-compose accepts it ---------------------------------------------------------------


def _compose_binary() -> str:
    """The checker's docker-compose; the tests that need it skip where it is absent."""
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed (CI: apt-get install -y docker-compose)")
    return binary


def _docker_compose(*args: str, env_file: Path) -> subprocess.CompletedProcess[str]:
    binary = _compose_binary()
    env = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/tmp")}
    return subprocess.run(
        [binary, "--env-file", str(env_file), "-f", str(COMPOSE_FILE), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
    )


@pytest.mark.parametrize("profile", [[], ["--profile", "sim"], ["--profile", "monitoring"]],
                         ids=["default", "sim", "monitoring"])
def test_docker_compose_config_accepts_the_file(profile: list[str], tmp_path: Path) -> None:
    env_file = tmp_path / "test.env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in compose_env().items()))
    done = _docker_compose(*profile, "config", "-q", env_file=env_file)
    assert done.returncode == 0, done.stderr
    # .env.example itself, as `cp .env.example .env` gives it, is accepted too.
    done = _docker_compose(*profile, "config", "-q", env_file=ENV_EXAMPLE)
    assert done.returncode == 0, done.stderr


def test_docker_compose_config_needs_no_env_file() -> None:
    """A fresh checkout has no .env: Compose must still read the file (the secrets are
    checked by the services themselves when they start, below)."""
    binary = _compose_binary()
    env = {k: v for k, v in os.environ.items() if k not in SECRETS}
    done = subprocess.run([binary, "-f", str(COMPOSE_FILE), "config", "-q"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def run_gate(service: dict[str, Any], env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    """The service's own start-up check, run here with a command that cannot start."""
    argv = argv_of(service.get("entrypoint") or service["command"])
    assert argv[:2] == ["sh", "-c"], argv
    script = argv[2].split("exec ", 1)[0] + "exit 0"
    return subprocess.run(["sh", "-c", script, *argv[3:]], env=dict(env),
                          capture_output=True, text=True, timeout=10)


@pytest.mark.parametrize(("missing", "service", "says"), [
    ("REDIS_PASSWORD", "redis", "set REDIS_PASSWORD in .env"),
    ("FLOWER_USER", "flower", "set FLOWER_USER and FLOWER_PASSWORD in .env"),
    ("FLOWER_PASSWORD", "flower", "set FLOWER_USER and FLOWER_PASSWORD in .env"),
    ("GRAFANA_PASSWORD", "grafana", "set GRAFANA_PASSWORD in .env"),
])
def test_a_service_refuses_to_start_without_its_secret(missing: str, service: str,
                                                       says: str) -> None:
    good = load_compose(compose_env())["services"][service]
    bad = load_compose(compose_env(**{missing: ""}))["services"][service]
    assert run_gate(good, good.get("environment", {})).returncode == 0
    done = run_gate(bad, bad.get("environment", {}))
    assert done.returncode != 0
    assert says in done.stderr


def test_postgres_gets_no_password_it_did_not_get_from_env() -> None:
    """The postgres image refuses to initialize without a superuser password, unless told to
    trust everyone: datagen's compose file never says so."""
    postgres = load_compose(compose_env(POSTGRES_PASSWORD=""))["services"]["postgres"]
    assert postgres["environment"]["POSTGRES_PASSWORD"] == ""
    assert "POSTGRES_HOST_AUTH_METHOD" not in postgres["environment"]


# -- the file's structure --------------------------------------------------------------------------


def test_profiles_and_sglang_url_defaults_fit_together() -> None:
    services = load_compose(compose_env())["services"]
    # Default `docker compose up` = the GPU stack, through COMPOSE_PROFILES=gpu in .env;
    # `--profile sim` replaces it, so the simulator runs instead of SGLang, not beside it.
    assert read_env_file(ENV_EXAMPLE)["COMPOSE_PROFILES"] == "gpu"
    assert services["sglang"]["profiles"] == ["gpu"]
    assert services["sim"]["profiles"] == ["sim"]
    assert services["prometheus"]["profiles"] == services["grafana"]["profiles"] == ["monitoring"]
    unprofiled = {"redis", "postgres", "worker", "producer", "flower"}
    assert {n for n, s in services.items() if "profiles" not in s} == unprofiled
    # The default URL reaches whichever server runs: the simulator answers to `sglang` too.
    assert services["worker"]["environment"]["DATAGEN_SGLANG_URL"] == "http://sglang:30000"
    assert "sglang" in services["sim"]["networks"]["default"]["aliases"]
    assert "--port 30000" in " ".join(argv_of(services["sim"]["command"]))
    assert "--port 30000" in " ".join(argv_of(services["sglang"]["command"]))
    # Nothing depends on a profiled service: `docker compose up redis postgres worker
    # producer flower` (SGLang elsewhere) must not pull one in.
    for name, service in services.items():
        assert not {"sglang", "sim"} & set(service.get("depends_on") or {}), name
    gpu = services["sglang"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and gpu["count"] == "all"


def test_secrets_are_required_and_never_committed() -> None:
    text = COMPOSE_FILE.read_text()
    for name in SECRETS:
        uses = re.findall(r"\$\{" + name + r"([^}]*)\}", text)
        assert uses, name
        # No default value: an unset secret stays empty and the service refuses to start.
        assert all(u == ":-" for u in uses), (name, uses)
    assert ".env" in (ROOT / ".gitignore").read_text().split()
    assert ".env" in (ROOT / ".dockerignore").read_text().split()


def test_every_setting_and_variable_is_passed_and_documented() -> None:
    raw = load_compose()
    anchor = raw["x-datagen-env"]
    documented = set(re.findall(r"^#?\s*([A-Z][A-Z0-9_]*)=", ENV_EXAMPLE.read_text(), re.M))
    for name in setting_env_names():
        assert name in anchor, f"{name} is not passed to the app services"
        assert name in documented, f"{name} is not described in .env.example"
    for name in set(re.findall(r"\$\{([A-Za-z_]\w*)", COMPOSE_FILE.read_text())):
        assert name in documented, f"${{{name}}} is not described in .env.example"
    for name in APP_SERVICES:
        assert raw["services"][name]["environment"] == anchor, name


def test_workers_scale_and_shut_down_warm() -> None:
    services = load_compose(compose_env())["services"]
    worker = services["worker"]
    assert "container_name" not in worker and "ports" not in worker
    timeout_s = float(worker["environment"]["DATAGEN_REQUEST_TIMEOUT_S"])
    assert seconds(worker["stop_grace_period"]) > timeout_s
    assert "inspect" not in " ".join(healthcheck_argv(worker))
    assert services["producer"]["restart"] == "no"
    assert services["producer"]["volumes"] == ["./examples:/prompts:ro"]
    for name in ("worker", "producer"):
        deps = services[name]["depends_on"]
        assert deps["redis"]["condition"] == deps["postgres"]["condition"] == "service_healthy"
    redis_command = " ".join(argv_of(services["redis"]["command"]))
    assert "--appendonly yes" in redis_command
    assert "--maxmemory-policy noeviction" in redis_command


def test_monitoring_scrapes_every_worker_and_grafana_reads_that_prometheus() -> None:
    services = load_compose(compose_env())["services"]
    worker_port = int(services["worker"]["environment"]["DATAGEN_METRICS_PORT"])
    assert worker_port > 0  # on in compose: each replica has its own network namespace
    scrape = {job["job_name"]: job for job in
              yaml.safe_load((MONITORING / "prometheus.yml").read_text())["scrape_configs"]}
    # Every replica of the worker service, by the name compose's DNS answers for them all.
    [workers] = scrape["datagen-worker"]["dns_sd_configs"]
    assert workers["names"] == ["worker"] and workers["type"] == "A"
    assert workers["port"] == worker_port
    # SGLang where the workers send their requests (the simulator answers there too).
    sglang = services["worker"]["environment"]["DATAGEN_SGLANG_URL"].removeprefix("http://")
    assert scrape["sglang"]["static_configs"] == [{"targets": [sglang]}]
    assert "--enable-metrics" in argv_of(services["sglang"]["command"])
    # Each file the two services mount is in the repository, and Grafana's datasource is
    # the Prometheus service, under the uid the dashboard queries.
    for name in ("prometheus", "grafana"):
        for volume in services[name]["volumes"]:
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), (name, volume)
        assert services[name]["ports"][0].startswith("127.0.0.1:"), name
    [source] = yaml.safe_load((MONITORING / "grafana/provisioning/datasources/prometheus.yml")
                              .read_text())["datasources"]
    prometheus_port = services["prometheus"]["ports"][0].rsplit(":", 1)[1]
    assert source["url"] == f"http://prometheus:{prometheus_port}"
    dashboard = (MONITORING / "grafana/dashboards/datagen.json").read_text()
    uids = set(re.findall(r'"uid":\s*"([^"]+)"', dashboard)) - {"datagen"}
    assert uids == {source["uid"]}
    [provider] = yaml.safe_load((MONITORING / "grafana/provisioning/dashboards/datagen.yml")
                                .read_text())["providers"]
    mounted = {v.split(":")[1]: v.split(":")[0] for v in services["grafana"]["volumes"]}
    assert mounted[provider["options"]["path"]] == "./monitoring/grafana/dashboards"
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == provider["options"]["path"] + "/datagen.json"


def test_dockerfile_builds_a_slim_non_root_image() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", text, re.M)
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0")
    assert "[dev]" not in text
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git", "*.db", ".pytest_cache"} <= set(ignored)


def test_healthcheck_says_unhealthy_when_a_service_does_not_answer(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DATAGEN_REDIS_URL", "redis://:secret@127.0.0.1:1/0")
    monkeypatch.setenv("DATAGEN_DATABASE_URL", "postgresql://u:secret@127.0.0.1:1/x")
    monkeypatch.setenv("DATAGEN_SGLANG_URL", "http://127.0.0.1:1")
    assert healthcheck.main(["worker"]) == healthcheck.UNHEALTHY
    assert healthcheck.main(["sglang"]) == healthcheck.UNHEALTHY
    assert healthcheck.main(["http", "http://127.0.0.1:1/healthcheck"]) == healthcheck.UNHEALTHY
    err = capsys.readouterr().err
    assert "Redis" in err and "database" in err and "secret" not in err


# -- (b) the services' own commands run a small job ------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass
class Local:
    """How container names map to this machine."""

    prompts: Path
    ports: dict[int, int]  # container port -> local port

    def path(self, value: str) -> str:
        if value == "/prompts" or value.startswith("/prompts/"):
            return str(self.prompts) + value[len("/prompts") :]
        if value.startswith("/app/"):
            return str(ROOT / value[len("/app/") :])
        return value

    def arg(self, value: str) -> str:
        value = self.path(value).replace("0.0.0.0", "127.0.0.1")
        for inside, outside in self.ports.items():
            value = re.sub(rf"(?<=[:=]){inside}\b", str(outside), value)
            if value == str(inside):
                value = str(outside)
        return value

    def url(self, value: str) -> str:
        """http://sglang:30000 or http://sim:30000 -> the local simulator."""
        return re.sub(r"//(sglang|sim):", "//127.0.0.1:", self.arg(value))

    def argv(self, argv: list[str]) -> list[str]:
        return [self.arg(a) for a in argv]

    def env(self, service: dict[str, Any]) -> dict[str, str]:
        inside = {k: str(v) for k, v in service["environment"].items()}
        assert inside["DATAGEN_REDIS_URL"] == f"redis://:{TEST_ENV['REDIS_PASSWORD']}@redis:6379/0"
        assert inside["DATAGEN_DATABASE_URL"].startswith(
            f"postgresql://datagen:{TEST_ENV['POSTGRES_PASSWORD']}@postgres:5432/")
        env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
        env.update({k: self.path(v) for k, v in inside.items()})
        env["DATAGEN_REDIS_URL"] = REDIS_URL
        env["DATAGEN_DATABASE_URL"] = POSTGRES_URL
        env["DATAGEN_SGLANG_URL"] = ",".join(
            self.url(u) for u in inside["DATAGEN_SGLANG_URL"].split(","))
        # The image's `datagen`, `celery` and `python` are the venv's here.
        env["PATH"] = f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"
        return env


class Processes:
    """Background processes with their logs; all stopped on exit, even after a failure."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.running: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        with open(self.logs / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.running[name] = proc
        return proc

    def tail(self, name: str, lines: int = 30) -> str:
        path = self.logs / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return f"--- {name} ---\n" + "\n".join(text.splitlines()[-lines:])

    def tails(self) -> str:
        return "\n".join(self.tail(n) for n in self.running)

    def stop_all(self) -> None:
        for proc in self.running.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 15
        for proc in self.running.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


@contextmanager
def processes(logs: Path) -> Iterator[Processes]:
    procs = Processes(logs)
    try:
        yield procs
    except BaseException:
        print(procs.tails())  # shown by pytest on failure
        raise
    finally:
        procs.stop_all()


def wait_until(check: Any, what: str, timeout_s: float, procs: Processes) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"{what} not ready in {timeout_s}s\n{procs.tails()}")


def run_healthcheck(name: str, service: dict[str, Any], local: Local) -> None:
    done = subprocess.run(local.argv(healthcheck_argv(service)), cwd=ROOT, env=local.env(service),
                          capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, f"{name} healthcheck: {done.stdout}{done.stderr}"


def small_prompts(tmp_path: Path) -> Path:
    """A copy of examples/ with the first lines of each prompt file."""
    folder = tmp_path / "prompts"
    shutil.copytree(ROOT / "examples", folder)
    for path in folder.rglob("*.jsonl"):
        lines = path.read_text().splitlines(keepends=True)[:PROMPTS_PER_FILE]
        path.write_text("".join(lines))
    return folder


def answers(url: str, **kwargs: Any) -> bool:
    try:
        return requests.get(url, timeout=2, **kwargs).status_code == 200
    except requests.RequestException:
        return False


def assert_scraped_counts_equal_sql(store: Store, ports: list[int], procs: Processes) -> None:
    """The workers' /metrics, parsed as Prometheus parses it, count the results SQL holds
    (a task's counter moves just after its commit: it gets a few seconds to catch up)."""
    with store.engine.connect() as conn:
        stored = conn.scalar(sa.select(sa.func.count()).select_from(results))

    def counted() -> float:
        total = 0.0
        for port in ports:
            body = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            total += sum(s.value for f in text_string_to_metric_families(body)
                         for s in f.samples if s.name == "datagen_samples_done_total")
        return total

    wait_until(lambda: counted() == stored, f"metrics counting {stored} results", 15, procs)


def test_compose_commands_run_a_small_job(redis_client: redis.Redis, tmp_path: Path) -> None:
    services = load_compose(compose_env())["services"]
    local = Local(small_prompts(tmp_path), {30000: free_port(), 5555: free_port()})
    (tmp_path / "logs").mkdir()
    _fresh_postgres()
    sim_url = f"http://127.0.0.1:{local.ports[30000]}"
    flower_url = f"http://127.0.0.1:{local.ports[5555]}"
    volume = services["producer"]["volumes"][0]
    assert volume.endswith(":/prompts:ro"), volume

    def argv(name: str) -> list[str]:
        s = services[name]
        return local.argv(argv_of(s.get("entrypoint")) + argv_of(s.get("command")))

    with processes(tmp_path / "logs") as procs:
        procs.start("sim", argv("sim"), local.env(services["sim"]))
        wait_until(lambda: answers(f"{sim_url}/health"), "simulator", 20, procs)
        # Two replicas, as with --scale worker=2; each passes its SGLang gate first. Each
        # container serves /metrics on the same port in its own network; here, each
        # process on a port of its own.
        metrics_ports = [free_port(), free_port()]
        for i, port in enumerate(metrics_ports, 1):
            env = {**local.env(services["worker"]), "DATAGEN_METRICS_PORT": str(port)}
            procs.start(f"worker-{i}", argv("worker"), env)
        procs.start("flower", argv("flower"), local.env(services["flower"]))

        producer = subprocess.run(argv("producer"), cwd=ROOT, env=local.env(services["producer"]),
                                  capture_output=True, text=True, timeout=60, check=False)
        assert producer.returncode == 0, producer.stdout + producer.stderr

        manifest = tomllib.loads((local.prompts / "datasets.toml").read_text())
        names = sorted(manifest["datasets"])
        store, ledger = Store(POSTGRES_URL), Ledger(redis_client)
        queued = sum(sum(store.prompt_counts(n).values()) for n in names)
        assert queued == PROMPTS_PER_FILE * len(names)
        try:
            wait_settled(store, names, timeout_s=40)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{procs.tails()}") from None
        assert_invariants(store, ledger, names)
        assert any(store.prompt_counts(n).get("done") for n in names)
        for name, proc in procs.running.items():
            assert proc.poll() is None, f"{name} exited early\n{procs.tail(name)}"
        assert_scraped_counts_equal_sql(store, metrics_ports, procs)

        wait_until(lambda: answers(f"{flower_url}/healthcheck"), "flower", 20, procs)
        assert requests.get(flower_url, timeout=10).status_code == 401
        auth = (TEST_ENV["FLOWER_USER"], TEST_ENV["FLOWER_PASSWORD"])
        assert requests.get(flower_url, auth=auth, timeout=10).status_code == 200
        assert requests.get(flower_url, auth=("tester", "wrong"), timeout=10).status_code == 401

        for name in ("worker", "flower", "sim"):
            run_healthcheck(name, services[name], local)
