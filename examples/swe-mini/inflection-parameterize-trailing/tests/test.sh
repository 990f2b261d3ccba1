#!/usr/bin/env bash
# SWE-style verdict: every FAIL_TO_PASS case (they fail on the buggy code) and every PASS_TO_PASS
# case (they pass either way) must pass. reward.json: reward 1 or 0, and the two pass rates.
# The expected values stay in /tests/config.json, which only this script (uid 0) reads: the tested
# code runs as nobody, gets only the case expressions and prints what they evaluate to; this script,
# which never imports it, compares.
chmod -R go-rwx /tests
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
# as nobody: the expressions on stdin (JSON), one JSON line a case on stdout: its repr, or the error.
# -I: /app is searched after the standard library, so an /app/json.py shadows nothing
RUNNER='import json, os, sys
exprs = json.load(sys.stdin)
out = open(os.dup(1), "w")
os.dup2(2, 1)  # what the tested code prints goes to the log
sys.path.append("/app")
def emit(i, **kw):
    out.write(json.dumps(dict(case=i, **kw)) + "\n")
    out.flush()
try:
    import inflection
except BaseException as e:
    inflection = e
for i, expr in enumerate(exprs):
    try:
        if isinstance(inflection, BaseException):
            raise inflection
        emit(i, repr=repr(eval(expr, {"inflection": inflection})))
    except BaseException as e:
        emit(i, error=type(e).__name__)
        print(f"case {i}: {expr}: {type(e).__name__}: {e}", file=sys.stderr)'
# as root, never importing the tested code: a case passes when exactly one line names it and that
# line's repr is the expected one (lines the tested code prints itself earn nothing)
GRADER='import json, sys
cfg = json.load(open("/tests/config.json"))
if sys.argv[1] == "exprs":
    print(json.dumps([c["expr"] for c in cfg[sys.argv[2]]]))
    raise SystemExit
def rate(name):
    seen = {}
    for line in open(f"{sys.argv[2]}/{name}", errors="replace"):
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if isinstance(d, dict) and type(d.get("case")) is int:
            seen.setdefault(d["case"], []).append(d.get("repr"))
    cases = cfg[name]
    return sum(seen.get(i) == [c["want"]] for i, c in enumerate(cases)), len(cases)
(f_ok, f_all), (p_ok, p_all) = rate("FAIL_TO_PASS"), rate("PASS_TO_PASS")
reward = int(f_all > 0 and f_ok == f_all and p_ok == p_all)
print(f"FAIL_TO_PASS {f_ok}/{f_all}  PASS_TO_PASS {p_ok}/{p_all}  reward {reward}")
with open("/logs/verifier/reward.json", "w") as f:
    f.write(json.dumps({"reward": reward, "fail_to_pass": f"{f_ok}/{f_all}", "pass_to_pass": f"{p_ok}/{p_all}"}) + "\n")'
grade() { (cd / && python3 -I -c "$GRADER" "$@"); }
got=$(mktemp -d)  # root's (0700): what each run printed
for list in FAIL_TO_PASS PASS_TO_PASS; do
  grade exprs "$list" | untrusted python3 -I -c "$RUNNER" | head -c 1048576 > "$got/$list"
done
grade tally "$got"
rm -rf "$got"
