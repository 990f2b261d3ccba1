#!/usr/bin/env bash
# reward = the fraction of 5 checks of is_prime and gcd that pass
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
# the tested module prints its answers; this script, which never imports it, grades them
out=$(untrusted python3 -c "
import mathx
for case in (lambda: mathx.is_prime(7), lambda: mathx.is_prime(9), lambda: mathx.is_prime(1),
             lambda: mathx.gcd(12, 18), lambda: mathx.gcd(7, 5)):
    try:
        print(repr(case()))
    except Exception:
        print('error')" 2>/dev/null | head -c 4096)
printf '%s' "$out" | python3 -I -c "
import sys
want = ['True', 'False', 'False', '6', '1']
got = sys.stdin.read().split()
print(sum(a == b for a, b in zip(got, want)) / len(want))" > /logs/verifier/reward.txt
