"""The compose subset Polar runs itself (``tasks/compose.py``) and the hardened ``docker run`` of a
service (``sandbox/services.py``), without a daemon. The live trial with services is in
sandbox/test_services_live.py."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from polar_trial.sandbox.services import ServiceError, Services
from polar_trial.sandbox.servicestandin import service_plan
from polar_trial.tasks import load_tasks
from polar_trial.tasks.compose import ComposeError, duration_s, read_compose


def compose(tmp_path: Path, text: str) -> Path:
    env = tmp_path / "environment"
    env.mkdir(parents=True, exist_ok=True)
    (env / "Dockerfile").write_text("FROM python:3.11-slim\nWORKDIR /app\n")
    p = env / "docker-compose.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def test_the_subset_is_read_in_start_order(tmp_path):
    p = compose(tmp_path, """
        x-common: &common
          environment: {TZ: UTC}
        services:
          main:
            build: .
            command: ["sh", "-c", "sleep infinity"]
            environment: [DB_URL=postgres://app@db/app]
            depends_on: {db: {condition: service_healthy}, cache: {condition: service_started}}
          db:
            image: "${DB_IMAGE:-postgres:16}"
            environment: {POSTGRES_PASSWORD: pw, POSTGRES_DB: app}
            depends_on: [cache]
            healthcheck: {test: ["CMD-SHELL", "pg_isready -U postgres"], interval: 1s, retries: 5, start_period: 1m30s}
          init:
            image: busybox
            entrypoint: /bin/sh -c
            command: ["echo ready"]
            depends_on: {db: {condition: service_healthy}}
          cache:
            <<: *common
            image: redis:7
            ports: ["6379:6379"]
    """)
    plan = read_compose(p, {})
    assert plan.names == ["cache", "db", "init"]  # each after what it depends on, whatever the file's order
    db = plan.services[1]
    assert db.image == "postgres:16" and db.environment == {"POSTGRES_PASSWORD": "pw", "POSTGRES_DB": "app"}
    assert db.healthcheck.argv == ["sh", "-c", "pg_isready -U postgres"] and db.healthcheck.start_period_s == 90
    assert plan.main_env == {"DB_URL": "postgres://app@db/app"}
    assert plan.main_depends_on == {"db": "service_healthy", "cache": "service_started"}
    assert any("services.cache.ports ignored" in n for n in plan.notes)
    assert plan.services[0].environment == {"TZ": "UTC"}  # merged from the x- anchor
    assert read_compose(p, {"DB_IMAGE": "postgres:15"}).services[1].image == "postgres:15"
    assert duration_s("1m30s", "x") == 90 and duration_s("500ms", "x") == 0.5


@pytest.mark.parametrize("text,why", [
    ("services:\n  web:\n    image: nginx\n    volumes: [./x:/y]\n", "services.web.volumes is not supported"),
    ("services:\n  web:\n    image: nginx\n    network_mode: host\n", "services.web.network_mode is not supported"),
    ("services:\n  web:\n    image: nginx\n    privileged: true\n", "services.web.privileged is not supported"),
    ("services:\n  web:\n    image: nginx\nnetworks: {a: {}}\n", "top-level 'networks' is not supported"),
    ("services:\n  main:\n    privileged: true\n", "services.main.privileged is not supported"),
    ("services:\n  main:\n    command: python app.py\n", "main runs Harbor's `sleep infinity`"),
    ("services:\n  web:\n    build: ../..\n", "outside environment/"),
    ("services:\n  web:\n    image: nginx\n    environment: [HOME_KEY]\n", "takes its value from the host's environment"),
    ("services:\n  a:\n    image: x\n    depends_on: [b]\n  b:\n    image: x\n    depends_on: [a]\n", "depends_on cycle"),
    ("services:\n  web:\n    image: ${NOPE}\n", "${NOPE} is not set"),
    ("services:\n  web:\n    image: --privileged\n", "must be an image reference"),
    ("x-0: &a [1,1,1,1,1,1,1,1,1,1]\nx-1: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a]\nx-2: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
     "x-3: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c]\nx-4: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d,*d]\nx-5: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e,*e]\n"
     "x-6: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f,*f]\nx-7: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g,*g]\n"
     "services:\n  web:\n    image: nginx\n    x-bomb: [*h,*h,*h,*h,*h,*h,*h,*h,*h,*h]\n", "more than 20000 values"),
    ("services:\n" + "".join(f"  s{i}:\n    image: nginx\n" for i in range(20)), "Polar runs at most 16"),
    ("services:\n  web:\n    image: \"-v /:/host\"\n", "must be an image reference"),
    ("services:\n  web:\n    image: nginx\n    depends_on: {x: {condition: service_ok}}\n", "condition = 'service_ok'"),
])
def test_what_is_outside_the_subset_is_refused_naming_the_key(tmp_path, text, why):
    with pytest.raises(ComposeError) as err:
        read_compose(compose(tmp_path, text), {})
    assert why in str(err.value), err.value


def test_the_loader_reads_compose_under_a_container_backend_and_refuses_it_locally(tmp_path):
    d = tmp_path / "t"
    compose(d, "services:\n  main:\n    environment: {MODE: x}\n  cache:\n    image: redis:7\n")
    (d / "task.toml").write_text('version = "1.0"\n')
    (d / "instruction.md").write_text("Use the cache.\n")
    (d / "tests").mkdir()
    (d / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    (t,) = load_tasks(d, container="docker")
    assert t.compose.names == ["cache"] and t.environment.env["MODE"] == "x"
    assert any("started by Polar in the main container's network namespace" in n for n in t.notes)
    with pytest.raises(ValueError, match="needs a container runtime"):
        load_tasks(d)


def test_a_service_runs_through_the_hardened_path_in_mains_network_namespace(tmp_path):
    p = compose(tmp_path, "services:\n  web:\n    image: nginx\n    entrypoint: [\"/bin/sh\", \"-c\"]\n"
                          "    command: [\"exec nginx\"]\n    environment: {A: b}\n")
    svc = read_compose(p, {}).services[0]
    args = Services("docker", None, None, caps=["CHOWN", "SETUID"], pids=64, memory_mb=256).run_args(svc, "polar-trial-x", "nginx")
    joined = " ".join(args)
    assert "--network container:polar-trial-x" in joined and "--cap-drop ALL" in joined
    assert "--security-opt no-new-privileges" in joined and "--log-driver none" in joined
    assert "--pids-limit 64" in joined and "--memory 256m" in joined and "-e A=b" in joined
    assert args[-3:] == ["nginx", "-c", "exec nginx"]  # the entrypoint's rest, then the command
    assert "--entrypoint /bin/sh" in joined and "--privileged" not in joined and "-p" not in args
    with pytest.raises(ServiceError, match="not an image reference"):  # an image read as an option
        Services("docker", None, None, caps=[]).run_args(svc, "polar-trial-x", "--privileged")


def test_service_stand_ins_cover_the_common_images():
    for image, pkg in (("redis:7", "redis-server"), ("postgres:16-alpine", "postgresql"),
                       ("docker.io/library/nginx:1.27", "nginx")):
        plan, cmd = service_plan(image)
        assert pkg in plan.packages and "NOT the tag's" in plan.why and cmd
    assert service_plan("ghcr.io/acme/private:1") is None
