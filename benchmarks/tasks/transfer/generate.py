"""Writes the transfer task family of ``benchmarks/bench_transfer.py`` (issue 41), deterministically.

Two families, train and eval sets disjoint in each:

* **shell** (``train/``, ``eval/``): file-system and shell tasks in Harbor's format that need a tool
  call (one or two: Pi's ``write``/``bash``/``edit``); the reward is read from the work dir by a
  hidden ``tests/test.sh``, never from what the model says. Every task has an ``operation``; the
  eval tasks are of two kinds: ``same-operation`` (an operation some train task asks, on other
  names and values) and ``new-operation`` (an operation no train task asks). The instructions are
  one sentence, as ``hello-file`` and ``make-dir``'s, which the base 0.5B solves 29-38% of the
  time under Pi (docs/tasks.md); ``count-lines`` and ``fix-add`` (two steps) it solved 0 of 11.
* **trivia** (``trivia-train.jsonl``, ``trivia-eval.jsonl``, JSONL shorthand): the cheap control
  of issue 41 item 4, one-word answers graded on the harness's final answer as
  ``benchmarks/tasks/learning.jsonl`` (``color-sky`` and ``water-wet`` are its tasks, measured at
  0.31-0.62 at base; the others are candidates for the 20-60% band, to be measured with
  ``bench_transfer.py --base-rates``).

``manifest.json`` lists every task with its operation and, for eval tasks, its kind.
``tests/runtime/test_transfer_tasks.py`` checks that the files on disk are this script's output,
and the disjointness.

    .venv/bin/python benchmarks/tasks/transfer/generate.py          # rewrite everything
    .venv/bin/python benchmarks/tasks/transfer/generate.py --check  # exit 1 if the files differ
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent

# ---------------------------------------------------------------------------------------------
# what a verifier checks (shell fragments; run by test.sh as root in /app, after the agent)

#: text of a file, newlines and surrounding blanks dropped, at most 4 KiB (a file the agent made
#: a link to /dev/zero or to something huge cannot stall the verifier)
_TEXT = "$(head -c 4096 {f} 2>/dev/null | tr -d '\\r' | sed -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//' | sed '/^$/d')"


def file_is(path: str, text: str) -> str:
    """``path`` is a regular file whose text (blank lines and edges trimmed) is exactly ``text``."""
    return f"[ -f {path} ] && [ ! -L {path} ] && [ \"{_TEXT.format(f=path)}\" = '{text}' ]"


def file_is_ci(path: str, text: str) -> str:
    """As :func:`file_is`, ignoring case and a final period (an answer written as a sentence's word)."""
    got = _TEXT.format(f=path)
    return (f"[ -f {path} ] && [ ! -L {path} ] && "
            f"[ \"$(printf %s \"{got}\" | tr 'A-Z' 'a-z' | sed 's/[.]$//')\" = '{text.lower()}' ]")


@dataclass
class ShellTask:
    id: str
    operation: str
    instruction: str
    files: dict[str, str]  # the work dir's files (COPY'd by the Dockerfile)
    check: str  # shell condition: true = reward 1
    solve: str  # the oracle, run in /app
    kind: str = ""  # eval only: same-operation | new-operation
    untrusted: bool = False  # the check runs a program of the work dir (as nobody: docs/sandbox.md)
    notes: list[str] = field(default_factory=list)


LINES = lambda *xs: "".join(x + "\n" for x in xs)  # noqa: E731

TRAIN: list[ShellTask] = [
    ShellTask("create-greeting", "create-file",
              "Create a file named greeting.txt in the current directory containing exactly the text: good morning",
              {}, file_is("greeting.txt", "good morning"), "printf 'good morning\\n' > greeting.txt"),
    ShellTask("create-todo", "create-file",
              "Create a file named todo.txt in the current directory containing exactly the text: water the plants",
              {}, file_is("todo.txt", "water the plants"), "printf 'water the plants\\n' > todo.txt"),
    ShellTask("append-log", "append-line",
              "Add the line: done to the end of the file log.txt, keeping its other lines.",
              {"log.txt": LINES("started", "running")},
              file_is("log.txt", "started\nrunning\ndone"), "printf 'done\\n' >> log.txt"),
    ShellTask("append-names", "append-line",
              "Add the line: carol to the end of the file names.txt, keeping its other lines.",
              {"names.txt": LINES("alice", "bob")},
              file_is("names.txt", "alice\nbob\ncarol"), "printf 'carol\\n' >> names.txt"),
    ShellTask("rename-draft", "rename-file",
              "Rename the file draft.txt to final.txt.",
              {"draft.txt": LINES("my draft")},
              "[ ! -e draft.txt ] && " + file_is("final.txt", "my draft"), "mv draft.txt final.txt"),
    ShellTask("count-fruits", "count-lines",
              "Count the lines of fruits.txt and write just that number into a new file count.txt.",
              {"fruits.txt": LINES("apple", "banana", "cherry", "plum", "kiwi")},
              file_is("count.txt", "5"), "wc -l < fruits.txt | tr -d ' ' > count.txt"),
    ShellTask("make-logs-dir", "make-dir",
              "Create a directory named logs in the current directory.",
              {}, "[ -d logs ] && [ ! -L logs ]", "mkdir logs"),
    ShellTask("delete-temp", "delete-file",
              "Delete the file temp.txt from the current directory.",
              {"temp.txt": LINES("scratch"), "keep.txt": LINES("keep me")},
              "[ ! -e temp.txt ] && " + file_is("keep.txt", "keep me"), "rm temp.txt"),
    ShellTask("copy-config", "copy-file",
              "Make a copy of the file config.ini named config.bak in the same directory.",
              {"config.ini": LINES("[main]", "debug = false")},
              file_is("config.bak", "[main]\ndebug = false") + " && " + file_is("config.ini", "[main]\ndebug = false"),
              "cp config.ini config.bak"),
]

EVAL: list[ShellTask] = [
    # same operation as a train task, other names and values
    ShellTask("create-poem", "create-file",
              "Create a file named poem.txt in the current directory containing exactly the text: roses are red",
              {}, file_is("poem.txt", "roses are red"), "printf 'roses are red\\n' > poem.txt", kind="same-operation"),
    ShellTask("append-shopping", "append-line",
              "Add the line: bread to the end of the file shopping.txt, keeping its other lines.",
              {"shopping.txt": LINES("milk", "eggs", "rice")},
              file_is("shopping.txt", "milk\neggs\nrice\nbread"), "printf 'bread\\n' >> shopping.txt",
              kind="same-operation"),
    ShellTask("rename-notes", "rename-file",
              "Rename the file notes.md to report.md.",
              {"notes.md": LINES("# notes", "all good")},
              "[ ! -e notes.md ] && " + file_is("report.md", "# notes\nall good"), "mv notes.md report.md",
              kind="same-operation"),
    # operations no train task asks
    ShellTask("csv-price", "extract-csv-field",
              "The file prices.csv has the columns name,price. Write the price of pear into a new file price.txt.",
              {"prices.csv": LINES("name,price", "apple,3", "pear,7", "plum,4")},
              file_is("price.txt", "7"), "awk -F, '$1 == \"pear\" {print $2}' prices.csv > price.txt",
              kind="new-operation"),
    ShellTask("find-word", "find-file-by-content",
              "One of the files a.txt, b.txt and c.txt contains the word zebra. Write the name of that file "
              "into a new file answer.txt.",
              {"a.txt": LINES("a lion sleeps"), "b.txt": LINES("the zebra runs"), "c.txt": LINES("a tiger hides")},
              file_is_ci("answer.txt", "b.txt"), "grep -l zebra a.txt b.txt c.txt > answer.txt", kind="new-operation"),
    ShellTask("fix-greet", "fix-and-run-script",
              "The script greet.sh has a typo: it calls ecko instead of echo. Fix it, then run it with bash "
              "greet.sh (it writes out.txt).",
              {"greet.sh": LINES("#!/bin/bash", "ecko 'hi there' > out.txt")},
              # the work left: out.txt as the fixed script writes it; and the fixed script itself, run
              # again as nobody in a scratch copy, must write the same (not only out.txt typed by hand)
              file_is("out.txt", "hi there") + " && "
              "d=$(mktemp -d) && cp greet.sh \"$d/\" && chmod -R a+rwX \"$d\" && "
              "(cd \"$d\" && untrusted timeout 10 bash greet.sh >/dev/null 2>&1; true) && "
              "[ \"$(head -c 4096 \"$d/out.txt\" 2>/dev/null)\" = 'hi there' ]",
              "sed -i 's/ecko/echo/' greet.sh && bash greet.sh", kind="new-operation", untrusted=True),
]

# ---------------------------------------------------------------------------------------------
# trivia (JSONL shorthand, graded on the harness's final answer)

#: the one-word grader of benchmarks/tasks/learning.jsonl, with the expected word as {word}
_ONE_WORD = ('a=$(tr -d "\\r" < "$POLAR_HARNESS_STDOUT" | sed "/^[[:space:]]*$/d"); '
             'w=$(printf %s "$a" | tr "A-Z" "a-z" | sed -e "s/^[[:space:]]*//" -e "s/[[:space:]]*$//" -e "s/[.!]$//"); '
             'printf "answer=%q\\n" "$a"; [ "$w" = {word} ]')


@dataclass
class Trivia:
    id: str
    question: str
    word: str
    note: str = ""


TRIVIA_TRAIN = [
    Trivia("color-sky", "What color is a clear daytime sky? Reply with one word only, nothing else.", "blue",
           "issue 26: 0.31 and 0.50 at base (32 samples each)"),
    Trivia("water-wet", "Is water wet? Answer with one word only: yes or no.", "yes",
           "issue 26: 0.62 and 0.59 at base (32 samples each)"),
    Trivia("tomato-fruit", "Is a tomato a fruit? Answer with one word only: yes or no.", "yes"),
    Trivia("spider-legs", "How many legs does a spider have? Reply with one number only, in digits.", "8"),
    Trivia("frozen-water", "What is frozen water called? Reply with one word only, nothing else.", "ice"),
    Trivia("color-grass", "What color is grass? Reply with one word only, nothing else.", "green"),
    # yes/no questions answered "no" beside the "yes" ones: a policy that only learned to say yes
    # fails these (the first reduced control's gain was that, benchmarks/history/transfer.md)
    Trivia("moon-planet", "Is the Moon a planet? Answer with one word only: yes or no.", "no"),
    Trivia("ice-hot", "Is ice hot? Answer with one word only: yes or no.", "no"),
]
TRIVIA_EVAL = [
    Trivia("color-banana", "What color is a ripe banana? Reply with one word only, nothing else.", "yellow"),
    Trivia("sun-star", "Is the Sun a star? Answer with one word only: yes or no.", "yes"),
    Trivia("week-days", "How many days are in a week? Reply with one number only, in digits.", "7"),
    Trivia("cow-sound", "What sound does a cow make? Reply with one word only, nothing else.", "moo"),
    Trivia("color-snow", "What color is fresh snow? Reply with one word only, nothing else.", "white"),
    Trivia("bat-mammal", "Is a bat a mammal? Answer with one word only: yes or no.", "yes"),
    Trivia("whale-fish", "Is a whale a fish? Answer with one word only: yes or no.", "no"),
    Trivia("snake-legs", "Does a snake have legs? Answer with one word only: yes or no.", "no"),
]

# ---------------------------------------------------------------------------------------------
# writing

TASK_TOML = """version = "1.0"

[metadata]
source = "polar benchmarks/tasks/transfer (issue 41), written by generate.py"
operation = "{operation}"
{kind}
# no [agent] timeout_sec: the run's --timeout applies

[verifier]
timeout_sec = 60.0

[environment]
cpus = 1
memory_mb = 2048
allow_internet = false
"""

UNTRUSTED = """# The tested program runs as nobody (uid 65534 of the sandbox): it cannot write /logs/verifier,
# signal this script or change its files. Only this script writes the reward (docs/sandbox.md).
untrusted() {
  python3 -I -c 'import os, sys
if os.geteuid() == 0:
    os.setgroups([]); os.setresgid(65534, 65534, 65534); os.setresuid(65534, 65534, 65534)
else:
    print("verifier: not uid 0, the tested program runs as this user", file=sys.stderr)
os.execvp(sys.argv[1], sys.argv[1:])' "$@"
}
"""


def task_files(t: ShellTask) -> dict[str, str]:
    """Relative path -> content of one Harbor task directory."""
    kind = f'kind = "{t.kind}"\n' if t.kind else ""
    out = {"task.toml": TASK_TOML.format(operation=t.operation, kind=kind),
           "instruction.md": t.instruction + "\n"}
    docker = ["FROM python:3.11-slim", "WORKDIR /app"] + [f"COPY {n} {n}" for n in sorted(t.files)]
    out["environment/Dockerfile"] = "\n".join(docker) + "\n"
    for n, content in t.files.items():
        out[f"environment/{n}"] = content
    test = ["#!/usr/bin/env bash", f"# {t.id} ({t.operation}): reward 1 when the work dir passes the check below",
            "chmod -R go-rwx /tests", "cd /app || exit 2", "mkdir -p /logs/verifier"]
    if t.untrusted:
        test.append(UNTRUSTED.rstrip("\n"))
    test.append(f"if {t.check}; then echo 1; else echo 0; fi > /logs/verifier/reward.txt")
    out["tests/test.sh"] = "\n".join(test) + "\n"
    out["solution/solve.sh"] = f"#!/usr/bin/env bash\ncd /app\n{t.solve}\n"
    return out


def trivia_line(t: Trivia) -> str:
    return json.dumps({"id": t.id, "instruction": t.question, "evaluator": _ONE_WORD.replace("{word}", t.word),
                       "reference": f"echo {t.word.capitalize()}.", "timeout": 120})


def manifest() -> dict:
    return {
        "about": "issue 41: tasks of benchmarks/bench_transfer.py, written by generate.py (do not edit by hand)",
        "families": {
            "shell": {
                "train_dir": "train", "eval_dir": "eval",
                "train": [{"id": t.id, "operation": t.operation} for t in TRAIN],
                "eval": [{"id": t.id, "operation": t.operation, "kind": t.kind} for t in EVAL],
            },
            "trivia": {
                "train_dir": "trivia-train.jsonl", "eval_dir": "trivia-eval.jsonl",
                "train": [{"id": t.id, "operation": "one-word-answer", "note": t.note} for t in TRIVIA_TRAIN],
                "eval": [{"id": t.id, "operation": "one-word-answer", "kind": "same-operation", "note": t.note}
                         for t in TRIVIA_EVAL],
            },
        },
    }


def render() -> dict[str, str]:
    """Every file this script owns, relative to its directory."""
    files: dict[str, str] = {}
    for where, tasks in (("train", TRAIN), ("eval", EVAL)):
        for t in tasks:
            for rel, content in task_files(t).items():
                files[f"{where}/{t.id}/{rel}"] = content
        files[f"{where}/dataset.toml"] = "tasks = [" + ", ".join(f'"{t.id}"' for t in tasks) + "]\n"
    head = "# Trivia control of benchmarks/bench_transfer.py ({}); written by generate.py\n"
    files["trivia-train.jsonl"] = head.format("train") + "".join(trivia_line(t) + "\n" for t in TRIVIA_TRAIN)
    files["trivia-eval.jsonl"] = head.format("eval") + "".join(trivia_line(t) + "\n" for t in TRIVIA_EVAL)
    files["manifest.json"] = json.dumps(manifest(), indent=2) + "\n"
    return files


def differences(root: Path = HERE) -> list[str]:
    """Paths where ``root`` differs from :func:`render` (missing, changed, or not ours under train/eval)."""
    want = render()
    out = [p for p, c in want.items() if not (root / p).is_file() or (root / p).read_text() != c]
    for d in ("train", "eval"):
        for f in (root / d).rglob("*") if (root / d).is_dir() else []:
            if f.is_file() and str(f.relative_to(root)) not in want:
                out.append(str(f.relative_to(root)))
    return sorted(out)


def write(root: Path = HERE) -> None:
    for d in ("train", "eval"):
        shutil.rmtree(root / d, ignore_errors=True)
    for rel, content in render().items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(content)
        if p.name.endswith(".sh"):
            p.chmod(0o755)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 when the files on disk are not this script's output")
    a = ap.parse_args()
    if a.check:
        diff = differences()
        for p in diff:
            print(f"differs: {p}")
        return 1 if diff else 0
    write()
    print(f"wrote {len(render())} files under {HERE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
