"""Build the swe-mini dataset: SWE-style Harbor tasks on a real small pure-Python project.

The project is ``inflection`` 0.5.1 (MIT, one 426-line module, no dependencies), vendored from its
PyPI sdist into each task's environment build context. Each task introduces one bug into
``inflection/__init__.py`` and phrases it as an issue; its hidden tests are SWE-bench's two lists:
FAIL_TO_PASS (fail on the buggy code, pass once fixed) and PASS_TO_PASS (pass either way: a fix
must not break them), each case an expression and its expected value (``tests/config.json``).
``tests/test.sh`` makes ``/tests`` root-only, hands each list's expressions to a runner that imports
the tested code as nobody and prints one JSON line a case (the result's repr, or the error), compares
them, as root and without importing the tested code, with the expected values, and writes
reward.json: ``reward`` 1 when every case of both lists passes, plus the two pass rates. Nothing the
tested code prints is taken as a result unless it equals the expected value, which it cannot read.
``solution/solve.sh`` reverts the bug.

Re-run from the repository root to regenerate the task directories (needs PyPI, or a pip cache
that has the sdist):

    .venv/bin/python examples/swe-mini/build.py
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
SDIST = "inflection==0.5.1"
KEEP = ("LICENSE", "README.rst", "setup.py", "setup.cfg", "inflection", "test_inflection.py")

TASKS = [
    {
        "id": "inflection-ordinal-hundreds",
        "issue": """\
            `inflection.ordinalize` gives the wrong suffix above one hundred:
            `ordinalize(111)` returns `'111st'` and `ordinalize(1012)` returns `'1012nd'`; both should end in
            `th`, as 11, 12 and 13 do. Fix the bug in the `inflection` package in the current directory.""",
        "good": "    if number % 100 in (11, 12, 13):\n",
        "bad": "    if number in (11, 12, 13):\n",
        "f2p": [("inflection.ordinalize(111)", '111th'),
                ("inflection.ordinalize(1012)", '1012th'),
                ("inflection.ordinalize(-113)", '-113th')],
        "p2p": [("inflection.ordinalize(1)", '1st'),
                ("inflection.ordinalize(2)", '2nd'),
                ("inflection.ordinalize(3)", '3rd'),
                ("inflection.ordinalize(11)", '11th'),
                ("inflection.ordinalize(21)", '21st'),
                ("inflection.ordinalize(1002)", '1002nd')],
    },
    {
        "id": "inflection-underscore-acronyms",
        "issue": """\
            `inflection.underscore` runs acronyms into the next word: `underscore('HTTPServer')` returns
            `'httpserver'` instead of `'http_server'`, and `underscore('IOError')` returns `'ioerror'` instead of
            `'io_error'`. Fix the bug in the `inflection` package in the current directory.""",
        "good": "    word = re.sub(r\"([A-Z]+)([A-Z][a-z])\", r'\\1_\\2', word)\n",
        "bad": "",
        "f2p": [("inflection.underscore('HTTPServer')", 'http_server'),
                ("inflection.underscore('IOError')", 'io_error'),
                ("inflection.tableize('XMLRecord')", 'xml_records')],
        "p2p": [("inflection.underscore('DeviceType')", 'device_type'),
                ("inflection.underscore('Product')", 'product'),
                ("inflection.underscore('area51Controller')", 'area51_controller'),
                ("inflection.underscore('special-guest')", 'special_guest')],
    },
    {
        "id": "inflection-parameterize-trailing",
        "issue": """\
            `inflection.parameterize` leaves a separator at the end of the slug when the text ends in
            punctuation: `parameterize('Hello, World!')` returns `'hello-world-'` instead of `'hello-world'`.
            Fix the bug in the `inflection` package in the current directory.""",
        "good": "        string = re.sub(r\"(?i)^{sep}|{sep}$\".format(sep=re_sep), '', string)\n",
        "bad": "        string = re.sub(r\"(?i)^{sep}\".format(sep=re_sep), '', string)\n",
        "f2p": [("inflection.parameterize('Hello, World!')", 'hello-world'),
                ("inflection.parameterize('Trailing bad characters!@#')", 'trailing-bad-characters'),
                ("inflection.parameterize('Trailing bad characters!@#', '_')", 'trailing_bad_characters')],
        "p2p": [("inflection.parameterize('Donald E. Knuth')", 'donald-e-knuth'),
                ("inflection.parameterize('Random text with *(bad)* characters')", 'random-text-with-bad-characters'),
                ("inflection.parameterize('Allow_Under_Scores')", 'allow_under_scores'),
                ("inflection.parameterize('!Leading bad characters')", 'leading-bad-characters')],
    },
]

TOML = """\
version = "1.0"

[metadata]
source = "examples/swe-mini (inflection 0.5.1 from PyPI, MIT)"
category = "debugging"
difficulty = "easy"
tags = ["swe", "python"]

[agent]
timeout_sec = 900.0

[verifier]
timeout_sec = 120.0

[environment]
build_timeout_sec = 120.0
cpus = 1
memory_mb = 2048
allow_internet = false
"""

DOCKERFILE = """\
FROM python:3.11-slim
WORKDIR /app
COPY project/ /app/
# a smoke check of the vendored package (runs inside the sandbox in the local mode)
RUN python3 -c "import inflection; print(inflection.__version__)"
"""

TEST_SH = r"""#!/usr/bin/env bash
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
"""


def solve_sh(good: str, bad: str) -> str:
    return ("#!/usr/bin/env bash\n# The reference fix: revert the introduced bug.\ncd /app\npython3 - <<'EOF'\n"
            "from pathlib import Path\np = Path('inflection/__init__.py')\ns = p.read_text()\n"
            f"good, bad = {good!r}, {bad!r}\n"
            "anchor = '    word = re.sub(r\"([a-z\\\\d])([A-Z])\", r\\'\\\\1_\\\\2\\', word)\\n'\n"
            "s = s.replace(bad, good, 1) if bad else s.replace(anchor, good + anchor, 1)\n"
            "p.write_text(s)\nEOF\n")


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SDIST,
                        "-d", tmp], check=True, capture_output=True)
        sdist = next(Path(tmp).glob("inflection-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        src = next(p for p in Path(tmp).iterdir() if p.is_dir())
        for t in TASKS:
            d = HERE / t["id"]
            if d.exists():
                shutil.rmtree(d)
            proj = d / "environment" / "project"
            proj.mkdir(parents=True)
            for name in KEEP:
                (shutil.copytree if (src / name).is_dir() else shutil.copy2)(src / name, proj / name)
            shutil.rmtree(proj / "inflection" / "__pycache__", ignore_errors=True)
            code = (proj / "inflection" / "__init__.py").read_text()
            assert code.count(t["good"]) == 1, t["id"]
            (proj / "inflection" / "__init__.py").write_text(code.replace(t["good"], t["bad"], 1))
            (d / "task.toml").write_text(TOML)
            (d / "instruction.md").write_text(textwrap.dedent(t["issue"]).strip() + "\n")
            (d / "environment" / "Dockerfile").write_text(DOCKERFILE)
            (d / "tests").mkdir()
            (d / "tests" / "test.sh").write_text(TEST_SH)
            (d / "tests" / "config.json").write_text(json.dumps(
                {name: [{"expr": expr, "want": repr(want)} for expr, want in t[key]]
                 for name, key in (("FAIL_TO_PASS", "f2p"), ("PASS_TO_PASS", "p2p"))}, indent=2) + "\n")
            (d / "solution").mkdir()
            (d / "solution" / "solve.sh").write_text(solve_sh(t["good"], t["bad"]))
            for sh in (d / "tests" / "test.sh", d / "solution" / "solve.sh"):
                sh.chmod(0o755)
            print(f"wrote {d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
