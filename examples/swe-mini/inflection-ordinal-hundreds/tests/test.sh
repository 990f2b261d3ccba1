#!/usr/bin/env bash
# SWE-style verdict: every FAIL_TO_PASS test (they fail on the buggy code) and every PASS_TO_PASS
# test (they pass either way) must pass. reward.json: reward 1 or 0, and the two pass rates.
mkdir -p /logs/verifier
cd /app || exit 2
rate() {  # run one list, print "passed total"
  python3 - "$1" <<'EOF'
import sys, unittest
sys.path.insert(0, "/app")
suite = unittest.defaultTestLoader.discover("/tests", pattern=sys.argv[1])
result = unittest.TextTestRunner(stream=sys.stderr, verbosity=2).run(suite)
bad = len(result.failures) + len(result.errors)
print(result.testsRun - bad, result.testsRun)
EOF
}
read -r f_ok f_all < <(rate 'test_fail_to_pass.py')
read -r p_ok p_all < <(rate 'test_pass_to_pass.py')
reward=0
if [ "${f_all:-0}" -gt 0 ] && [ "$f_ok" = "$f_all" ] && [ "$p_ok" = "$p_all" ]; then reward=1; fi
echo "FAIL_TO_PASS ${f_ok:-0}/${f_all:-0}  PASS_TO_PASS ${p_ok:-0}/${p_all:-0}  reward $reward"
printf '{"reward": %s, "fail_to_pass": "%s/%s", "pass_to_pass": "%s/%s"}\n' \
  "$reward" "${f_ok:-0}" "${f_all:-0}" "${p_ok:-0}" "${p_all:-0}" > /logs/verifier/reward.json
