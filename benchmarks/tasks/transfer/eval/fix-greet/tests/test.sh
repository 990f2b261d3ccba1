#!/usr/bin/env bash
# fix-greet (fix-and-run-script): reward 1 when the work dir passes the check below
chmod -R go-rwx /tests
cd /app || exit 2
mkdir -p /logs/verifier
# The tested program runs as nobody (uid 65534 of the sandbox): it cannot write /logs/verifier,
# signal this script or change its files. Only this script writes the reward (docs/sandbox.md).
untrusted() {
  python3 -I -c 'import os, sys
if os.geteuid() == 0:
    os.setgroups([]); os.setresgid(65534, 65534, 65534); os.setresuid(65534, 65534, 65534)
else:
    print("verifier: not uid 0, the tested program runs as this user", file=sys.stderr)
os.execvp(sys.argv[1], sys.argv[1:])' "$@"
}
if [ -f out.txt ] && [ ! -L out.txt ] && [ "$(head -c 4096 out.txt 2>/dev/null | tr -d '\r' | sed -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//' | sed '/^$/d')" = 'hi there' ] && d=$(mktemp -d) && cp greet.sh "$d/" && chmod -R a+rwX "$d" && (cd "$d" && untrusted timeout 10 bash greet.sh >/dev/null 2>&1; true) && [ "$(head -c 4096 "$d/out.txt" 2>/dev/null)" = 'hi there' ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
