"""The deployment examples under docs/deploy/ (docker-compose with Redis, workers, the metrics
exporter, Prometheus and Grafana; the Grafana dashboard) hang together: every file they mount exists,
Prometheus scrapes the port the exporter listens on with options the CLI has, Grafana is provisioned
with the dashboard, and the dashboard queries only metrics the exporter has (tests/test_metrics.py checks
those against a real crawl). No Docker engine runs here: the files are parsed, not started."""

from __future__ import annotations

import re
from typing import Any

import yaml
from helpers import DEPLOY, dashboard_metrics

from scrapy_dist.cli import main

DOCS = DEPLOY.parent / "monitoring.md"


def _yaml(name: str) -> Any:
    return yaml.safe_load((DEPLOY / name).read_text())


def test_compose_mounts_builds_and_scrapes_what_exists() -> None:
    compose = _yaml("docker-compose.yml")
    services = compose["services"]
    assert set(services) == {"redis", "worker", "metrics", "prometheus", "grafana"}
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name} mounts {source}, which is not in docs/deploy"
        build = service.get("build")
        if build:
            assert (DEPLOY / build["context"] / build["dockerfile"]).is_file()
    assert services["worker"]["environment"]["REDIS_URL"].startswith("redis://redis:")
    # the exporter: an existing subcommand with options it has, on the port Prometheus scrapes
    command = services["metrics"]["command"]
    assert command[:2] == ["scrapy-dist", "metrics"]
    options = {opt for p in main.commands["metrics"].params for opt in getattr(p, "opts", [])}
    assert {c for c in command if c.startswith("--")} <= options
    port = command[command.index("--port") + 1]
    targets = [t for job in _yaml("prometheus.yml")["scrape_configs"] for c in job["static_configs"]
               for t in c["targets"]]
    assert targets == [f"metrics:{port}"]
    # Grafana: the Prometheus service as data source, the dashboards folder where it is mounted
    source = _yaml("grafana/provisioning/datasources/prometheus.yml")["datasources"][0]
    assert source["url"] == "http://prometheus:9090" and "9090:9090" in services["prometheus"]["ports"]
    provider = _yaml("grafana/provisioning/dashboards/scrapy-dist.yml")["providers"][0]
    mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"])
    assert mounts["./grafana/dashboards"] == provider["options"]["path"]


def test_the_dashboard_queries_documented_metrics_only() -> None:
    documented = {n.removesuffix("_total")
                  for n in re.findall(r"^\| `(scrapy_dist_\w+)`", DOCS.read_text(), re.MULTILINE)}
    used = dashboard_metrics()
    assert len(used) >= 10
    assert used <= documented, used - documented
