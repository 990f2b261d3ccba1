"""Stand-ins for the service images multi-container tasks use most (redis, postgres, nginx), built
from Debian packages where no image registry answers (``standin.py``'s machinery: debootstrap of
a Debian release, the packages installed with apt in it, cached as a tarball, ``docker import``-ed
under the name the task asked for, labelled with a sentence saying what it really is).

Each starts as the official image does, from the same environment variables:

* ``redis``: ``redis-server`` on 0.0.0.0:6379, protected mode off (the official image's config);
* ``postgres``: on first start ``initdb`` of ``$PGDATA`` (``/var/lib/postgresql/data``) as the
  ``postgres`` user with ``POSTGRES_USER`` (default ``postgres``), ``POSTGRES_PASSWORD``
  (md5 over TCP; ``POSTGRES_HOST_AUTH_METHOD=trust`` as in the image) and ``POSTGRES_DB``, then
  ``postgres`` listening on every address, port 5432; ``pg_isready`` is there for healthchecks;
* ``nginx``: ``nginx -g 'daemon off;'`` with Debian's default site (port 80).

The versions are Debian's (bookworm: Redis 7.0, PostgreSQL 15, nginx 1.22), not the tag's, and
the sentence says so. An image with a command of its own in the compose file runs that command,
as the real image would.
"""

from __future__ import annotations

import re
import subprocess
import time

from polar_trial.sandbox.standin import (_HUB_MIRRORS, CA_PATH, INPUTS_LABEL, STANDIN_LABEL, Plan, StandInError,
                                           host_ca_bundle, image_exists, inputs_digest, rootfs_tarball)

_PATH = "/usr/lib/postgresql/15/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

_POSTGRES_START = r"""set -e
: "${PGDATA:=/var/lib/postgresql/data}"; export PGDATA
mkdir -p "$PGDATA" /var/run/postgresql
chown -R postgres:postgres "$PGDATA" /var/run/postgresql; chmod 700 "$PGDATA"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  user="${POSTGRES_USER:-postgres}"; db="${POSTGRES_DB:-$user}"
  printf '%s\n' "${POSTGRES_PASSWORD:-}" > /tmp/.pgpw; chown postgres /tmp/.pgpw
  runuser -u postgres -- initdb -D "$PGDATA" -U "$user" --pwfile=/tmp/.pgpw --auth-local=trust \
    --auth-host="${POSTGRES_HOST_AUTH_METHOD:-md5}" >/dev/null
  rm -f /tmp/.pgpw
  echo "host all all all ${POSTGRES_HOST_AUTH_METHOD:-md5}" >> "$PGDATA/pg_hba.conf"
  if [ "$db" != postgres ]; then
    runuser -u postgres -- postgres --single -D "$PGDATA" postgres <<EOF >/dev/null
CREATE DATABASE "$db";
EOF
  fi
fi
exec runuser -u postgres -- postgres -D "$PGDATA" -c listen_addresses='*'
"""

#: name -> (Debian packages, the command, the sentence's versions)
SERVICES = {
    "redis": (("redis-server",), ["redis-server", "--bind", "0.0.0.0", "--protected-mode", "no", "--save", ""],
              "Redis 7.0"),
    "postgres": (("postgresql", "postgresql-client"), ["sh", "-c", _POSTGRES_START], "PostgreSQL 15"),
    "nginx": (("nginx",), ["nginx", "-g", "daemon off;"], "nginx 1.22"),
}


def service_plan(image: str) -> tuple[Plan, list[str]] | None:
    """The stand-in of a service image and its command (None: no service stand-in for it)."""
    name, _, tag = image.partition("@")[0].partition(":")
    name = _HUB_MIRRORS.sub("", name, count=1)
    if name not in SERVICES:
        return None
    pkgs, cmd, versions = SERVICES[name]
    why = (f"stand-in for {image}: Debian bookworm with its {versions} (NOT the tag's {tag or 'latest'}), "
           "built locally by debootstrap (no registry reachable)")
    return Plan(image, "bookworm", False, why, packages=pkgs, toolchain=f"svc-{name}"), cmd


def ensure_service_image(image: str, runtime: str = "docker") -> str | None:
    """Make ``image`` exist as its stand-in; the stand-in sentence, or None when there is none."""
    found = service_plan(image)
    if found is None:
        return None
    plan, cmd = found
    if image_exists(image, runtime=runtime):
        r = subprocess.run([runtime, "image", "inspect", "--format", "{{index .Config.Labels \"%s\"}}" % INPUTS_LABEL,
                            image], capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if r.stdout.strip() == inputs_digest():
            return plan.why
    tar, _ = rootfs_tarball(plan)
    env = [f"PATH={_PATH}", "LANG=C.UTF-8"]
    if host_ca_bundle():
        env += [f"SSL_CERT_FILE={CA_PATH}"]
    changes = [f'LABEL {STANDIN_LABEL}="{plan.why}"', f"LABEL {INPUTS_LABEL}={inputs_digest()}",
               *(f"ENV {e}" for e in env), "CMD " + _json(cmd)]
    if plan.toolchain == "svc-postgres":
        changes.append("ENV PGDATA=/var/lib/postgresql/data")
    cmdline = [runtime, "import"]
    for c in changes:
        cmdline += ["--change", c]
    t0 = time.monotonic()
    r = subprocess.run([*cmdline, str(tar), image], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise StandInError(f"docker import of the stand-in for {image} failed: {r.stderr.strip()[-600:]}")
    return plan.why + f" (imported in {time.monotonic() - t0:.1f} s)"


def _json(argv: list[str]) -> str:
    import json

    return json.dumps(argv)


def is_service_image(image: str) -> bool:
    return re.sub(r"[:@].*", "", _HUB_MIRRORS.sub("", image, count=1)) in SERVICES
