"""Which ``uvx`` calls of a test.sh get the bootstrap's pytest on Polar's Python
(``polar_trial/sandbox/pytestboot.py``), and what reaches the host's ``pip install`` from them.
The live attack (a sitecustomize in the image's Python) is in ``sandbox/test_trial_live.py``."""

from __future__ import annotations

from polar_trial.sandbox.pytestboot import key, pytest_requirements


def test_tb2s_form_and_its_requirement_list_in_order():
    sh = ("uvx \\\n  -p 3.13 \\\n  -w pytest==8.4.1 \\\n  -w pytest-json-ctrf==0.3.5 \\\n"
          "  pytest --ctrf /logs/verifier/ctrf.json /tests/test_outputs.py -rA\n")
    assert pytest_requirements(sh) == [["pytest==8.4.1", "pytest-json-ctrf==0.3.5"]]
    assert key(["pytest==8.4.1", "pytest-json-ctrf==0.3.5"]) == "pytest==8.4.1+pytest-json-ctrf==0.3.5"
    assert pytest_requirements("uvx pytest -q\n") == [[]] and key([]) == "-"
    assert pytest_requirements("uvx --with=numpy>=2,<3 -w 'requests[socks]' pytest -p no:x\n") == [
        ["numpy>=2,<3", "requests[socks]"]]


def test_nothing_pip_would_read_as_an_option_a_path_or_a_url_reaches_the_host():
    """The requirements go to ``pip install`` on the host: a task's ``-w`` must never be an option
    (``--index-url``), a path or a URL; and only pytest runs are taken over."""
    for sh in ("uvx -w --index-url=http://127.0.0.1:1/ pytest\n", "uvx -w ../evil pytest\n",
               "uvx -w ./pkg pytest\n", "uvx -w https://example.invalid/x.whl pytest\n",
               "uvx -w 'x @ file:///etc' pytest\n", "uvx --from pytest==7 pytest\n",
               "uvx -w pytest ruff check .\n", "uv run pytest\n", "# uvx -w pytest pytest\n"):
        assert pytest_requirements(sh) == [], sh
