"""``polar view``: one page from the harness's request to the gradient (docs/view.md).

- ``runfiles.py``: every read of the run directory, through the sandbox's no-follow reader;
- ``summary.py``: the run page's data (rewards, pass rates, staleness, idle, phases, drift, merges);
- ``sample.py``: a sample's data (conversation, verdict, calls, sequences with the trainer's record);
- ``flows.py``: a call's raw request and response from the saved flows;
- ``model.py``: :class:`RunView`, the run loaded once and refreshed by what changed;
- ``chunks.py``: the report directory and the script-safe JSON of its data chunks;
- ``server.py``: ``--serve``; ``commands.py``: the CLI;
- ``static/``: the page (DOM by textContent only); ``vendor/uplot-1.6.32/``: uPlot, MIT, from npm.
"""
