"""Build the swe-mini dataset: SWE-style Harbor tasks on a real small pure-Python project.

The project is ``inflection`` 0.5.1 (MIT, one 426-line module, no dependencies), vendored from its
PyPI sdist into each task's environment build context. Each task introduces one bug into
``inflection/__init__.py`` and phrases it as an issue; its hidden tests are SWE-bench's two lists:
FAIL_TO_PASS (fail on the buggy code, pass once fixed) and PASS_TO_PASS (pass either way: a fix
must not break them). ``tests/test.sh`` runs both with the standard library's unittest (no pytest
needed in the sandbox) and writes reward.json: ``reward`` 1 when every test of both lists passes,
plus the two pass rates. ``solution/solve.sh`` reverts the bug.

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
        "f2p": ["self.assertEqual(inflection.ordinalize(111), '111th')",
                "self.assertEqual(inflection.ordinalize(1012), '1012th')",
                "self.assertEqual(inflection.ordinalize(-113), '-113th')"],
        "p2p": ["self.assertEqual(inflection.ordinalize(1), '1st')",
                "self.assertEqual(inflection.ordinalize(2), '2nd')",
                "self.assertEqual(inflection.ordinalize(3), '3rd')",
                "self.assertEqual(inflection.ordinalize(11), '11th')",
                "self.assertEqual(inflection.ordinalize(21), '21st')",
                "self.assertEqual(inflection.ordinalize(1002), '1002nd')"],
    },
    {
        "id": "inflection-underscore-acronyms",
        "issue": """\
            `inflection.underscore` runs acronyms into the next word: `underscore('HTTPServer')` returns
            `'httpserver'` instead of `'http_server'`, and `underscore('IOError')` returns `'ioerror'` instead of
            `'io_error'`. Fix the bug in the `inflection` package in the current directory.""",
        "good": "    word = re.sub(r\"([A-Z]+)([A-Z][a-z])\", r'\\1_\\2', word)\n",
        "bad": "",
        "f2p": ["self.assertEqual(inflection.underscore('HTTPServer'), 'http_server')",
                "self.assertEqual(inflection.underscore('IOError'), 'io_error')",
                "self.assertEqual(inflection.tableize('XMLRecord'), 'xml_records')"],
        "p2p": ["self.assertEqual(inflection.underscore('DeviceType'), 'device_type')",
                "self.assertEqual(inflection.underscore('Product'), 'product')",
                "self.assertEqual(inflection.underscore('area51Controller'), 'area51_controller')",
                "self.assertEqual(inflection.underscore('special-guest'), 'special_guest')"],
    },
    {
        "id": "inflection-parameterize-trailing",
        "issue": """\
            `inflection.parameterize` leaves a separator at the end of the slug when the text ends in
            punctuation: `parameterize('Hello, World!')` returns `'hello-world-'` instead of `'hello-world'`.
            Fix the bug in the `inflection` package in the current directory.""",
        "good": "        string = re.sub(r\"(?i)^{sep}|{sep}$\".format(sep=re_sep), '', string)\n",
        "bad": "        string = re.sub(r\"(?i)^{sep}\".format(sep=re_sep), '', string)\n",
        "f2p": ["self.assertEqual(inflection.parameterize('Hello, World!'), 'hello-world')",
                "self.assertEqual(inflection.parameterize('Trailing bad characters!@#'), 'trailing-bad-characters')",
                "self.assertEqual(inflection.parameterize('Trailing bad characters!@#', '_'), 'trailing_bad_characters')"],
        "p2p": ["self.assertEqual(inflection.parameterize('Donald E. Knuth'), 'donald-e-knuth')",
                "self.assertEqual(inflection.parameterize('Random text with *(bad)* characters'), "
                "'random-text-with-bad-characters')",
                "self.assertEqual(inflection.parameterize('Allow_Under_Scores'), 'allow_under_scores')",
                "self.assertEqual(inflection.parameterize('!Leading bad characters'), 'leading-bad-characters')"],
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

TEST_SH = """\
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
printf '{"reward": %s, "fail_to_pass": "%s/%s", "pass_to_pass": "%s/%s"}\\n' \\
  "$reward" "${f_ok:-0}" "${f_all:-0}" "${p_ok:-0}" "${p_all:-0}" > /logs/verifier/reward.json
"""


def tests_module(name: str, lines: list[str]) -> str:
    body = "\n".join(f"    def test_{i}(self):\n        {line}\n" for i, line in enumerate(lines))
    return f'"""{name} (hidden from the agent; placed at /tests after its phase)."""\n\nimport unittest\n\nimport inflection\n\n\nclass Test(unittest.TestCase):\n{body}'


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
            (d / "tests" / "test_fail_to_pass.py").write_text(tests_module("FAIL_TO_PASS", t["f2p"]))
            (d / "tests" / "test_pass_to_pass.py").write_text(tests_module("PASS_TO_PASS", t["p2p"]))
            (d / "tests" / "config.json").write_text(json.dumps(
                {"FAIL_TO_PASS": t["f2p"], "PASS_TO_PASS": t["p2p"]}, indent=2) + "\n")
            (d / "solution").mkdir()
            (d / "solution" / "solve.sh").write_text(solve_sh(t["good"], t["bad"]))
            for sh in (d / "tests" / "test.sh", d / "solution" / "solve.sh"):
                sh.chmod(0o755)
            print(f"wrote {d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
