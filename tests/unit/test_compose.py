"""docker-compose.yml matches examples/sync_users and the README (the file is not run:
there is no Docker here, so its commands, settings and module paths are checked)."""

from __future__ import annotations

import importlib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
CELERY_SERVICES = ("worker1", "worker2", "beat", "flower")


def _services() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())["services"]  # type: ignore[no-any-return]


def _example_dir(service: dict[str, Any]) -> Path:
    """The repository folder a service's working_dir (``/src/...``) points at."""
    workdir = service["working_dir"]
    assert workdir.startswith("/src/"), workdir
    return ROOT / workdir.removeprefix("/src/")


def _argv(service: dict[str, Any]) -> list[str]:
    return shlex.split(service["command"])


def test_every_celery_service_runs_the_sync_users_app() -> None:
    """Workers, beat and Flower run `celery -A tasks` in examples/sync_users, built from a
    Dockerfile that exists and installs this package, Flower and the examples."""
    services = _services()
    for name in CELERY_SERVICES:
        service = services[name]
        argv = _argv(service)
        assert argv[:3] == ["celery", "-A", "tasks"], (name, argv)
        folder = _example_dir(service)
        assert folder == ROOT / "examples" / "sync_users"
        assert (folder / "tasks.py").is_file()
        dockerfile = ROOT / service["build"]["context"] / service["build"]["dockerfile"]
        text = dockerfile.read_text()
        assert "COPY celery_redlock" in text and "COPY examples" in text
        assert re.search(r"pip install .*\. flower", text)
        assert f"WORKDIR {service['working_dir']}" in text


def test_workers_are_prefork_and_send_events_for_flower_and_beat_leads() -> None:
    """Two prefork workers with -E (the redlock-* events Flower counts), distinct names;
    beat uses LeaderScheduler, which imports."""
    services = _services()
    names = set()
    for name in ("worker1", "worker2"):
        argv = _argv(services[name])
        assert argv[3] == "worker" and "-E" in argv
        assert argv[argv.index("-P") + 1] == "prefork"
        names.add(argv[argv.index("-n") + 1])
    assert len(names) == 2
    beat = _argv(services["beat"])
    scheduler = beat[beat.index("-S") + 1]
    module, _, attr = scheduler.partition(":")
    assert hasattr(importlib.import_module(module), attr)
    assert _argv(services["flower"])[3] == "flower"
    assert "5555:5555" in services["flower"]["ports"]


def test_settings_are_the_ones_the_example_reads_and_point_at_compose_services() -> None:
    """Every environment variable tasks.py reads is set, nothing else; each URL names a
    service of the file (RabbitMQ for the broker, Redis for locks and results)."""
    services = _services()
    source = (ROOT / "examples" / "sync_users" / "tasks.py").read_text()
    read = set(re.findall(r"os\.environ\.get\(\s*\"(\w+)\"", source))
    for name in CELERY_SERVICES:
        env = services[name]["environment"]
        assert set(env) == read, name
        for value in env.values():
            host = urlsplit(value).hostname
            assert host in services, (name, value)
        assert urlsplit(env["CELERY_BROKER_URL"]).hostname == "rabbitmq"
        assert urlsplit(env["REDLOCK_URL"]).hostname == "redis"
        assert set(services[name]["depends_on"]) == {"redis", "rabbitmq"}


def test_the_app_loads_with_the_compose_settings_and_schedules_its_own_task() -> None:
    """Importing tasks.py with the compose environment gives an app whose lock store is
    the compose Redis and whose beat schedule names a task it defines."""
    service = _services()["beat"]
    env = {**os.environ, **service["environment"]}
    code = (
        "import json, tasks; a = tasks.app; "
        "print(json.dumps({'tasks': sorted(a.tasks), 'url': a.conf.redlock_url, "
        "'broker': a.conf.broker_url, "
        "'scheduled': [e['task'] for e in a.conf.beat_schedule.values()]}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=_example_dir(service),
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    info = json.loads(done.stdout.strip().splitlines()[-1])
    assert info["url"] == service["environment"]["REDLOCK_URL"]
    assert info["broker"] == service["environment"]["CELERY_BROKER_URL"]
    assert info["scheduled"] and set(info["scheduled"]) <= set(info["tasks"])


def test_readme_shows_the_compose_commands_as_the_file_runs_them() -> None:
    """The README's docker compose section lists each service's command verbatim and the
    example's folder, so the two cannot drift apart."""
    readme = (ROOT / "README.md").read_text()
    assert "docker compose up --build" in readme
    assert "examples/sync_users" in readme
    for name in CELERY_SERVICES:
        assert _services()[name]["command"] in readme, name
