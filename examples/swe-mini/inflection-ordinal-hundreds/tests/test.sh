#!/usr/bin/env bash
# SWE-style verdict: every FAIL_TO_PASS test (they fail on the buggy code) and every PASS_TO_PASS
# test (they pass either way) must pass. reward.json: reward 1 or 0, and the two pass rates.
mkdir -p /logs/verifier
cd /app || exit 2
# The tested code runs as nobody (uid 65534 of the sandbox): it cannot write /logs/verifier,
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
rate() {  # run one list as nobody, print "passed total" (its last line: the tested code may print)
  # -I: /app is searched after the standard library, so an /app/unittest.py shadows nothing
  untrusted python3 -I - "$1" <<'EOF' | tail -n 1
import sys, unittest
sys.path.append("/app")
suite = unittest.defaultTestLoader.discover("/tests", pattern=sys.argv[1], top_level_dir="/tests")
result = unittest.TextTestRunner(stream=sys.stderr, verbosity=2).run(suite)
bad = len(result.failures) + len(result.errors)
print(result.testsRun - bad, result.testsRun)
EOF
}
read -r f_ok f_all < <(rate 'test_fail_to_pass.py')
read -r p_ok p_all < <(rate 'test_pass_to_pass.py')
case "$f_ok$f_all$p_ok$p_all" in *[!0-9]*) f_ok=0 f_all=0 p_ok=0 p_all=0 ;; esac
reward=0
if [ "${f_all:-0}" -gt 0 ] && [ "$f_ok" = "$f_all" ] && [ "$p_ok" = "$p_all" ]; then reward=1; fi
echo "FAIL_TO_PASS ${f_ok:-0}/${f_all:-0}  PASS_TO_PASS ${p_ok:-0}/${p_all:-0}  reward $reward"
printf '{"reward": %s, "fail_to_pass": "%s/%s", "pass_to_pass": "%s/%s"}\n' \
  "$reward" "${f_ok:-0}" "${f_all:-0}" "${p_ok:-0}" "${p_all:-0}" > /logs/verifier/reward.json
