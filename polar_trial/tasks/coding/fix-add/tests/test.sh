#!/usr/bin/env bash
# reward 1 when calc.add adds (two cases)
# the expected answers below are this script's own: nobody, who runs the tested program, cannot read /tests
chmod -R go-rwx /tests
cd /app || exit 2
mkdir -p /logs/verifier
# The tested program runs as nobody (uid 65534 of the sandbox): it cannot write /logs/verifier,
# signal this script or change its files. Only this script writes the reward (docs/tasks.md).
untrusted() {
  python3 -I -c 'import os, sys
if os.geteuid() == 0:
    os.setgroups([]); os.setresgid(65534, 65534, 65534); os.setresuid(65534, 65534, 65534)
else:
    print("verifier: not uid 0, the tested program runs as this user", file=sys.stderr)
os.execvp(sys.argv[1], sys.argv[1:])' "$@"
}
chmod -R a+rX /app 2>/dev/null
export PYTHONDONTWRITEBYTECODE=1
out=$(untrusted python3 -c 'import calc; print(calc.add(2, 3)); print(calc.add(-1, 1))' 2>/dev/null | head -c 4096)
if [ "$out" = "$(printf '5\n0')" ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
