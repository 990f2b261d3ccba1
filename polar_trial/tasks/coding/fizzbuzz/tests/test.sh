#!/usr/bin/env bash
# reward = the fraction of fizzbuzz.py's 15 lines that are right (partial credit)
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
out=$(untrusted python3 fizzbuzz.py 2>/dev/null | head -c 65536)
printf '%s' "$out" | python3 -I -c "
import sys
want = ['FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0 else 'Buzz' if i % 5 == 0 else str(i) for i in range(1, 16)]
got = sys.stdin.read().split()
print(sum(a == b for a, b in zip(got, want)) / 15)" > /logs/verifier/reward.txt
