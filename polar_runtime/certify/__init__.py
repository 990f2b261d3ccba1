"""``polar certify``: will every sampled token of this harness on this model be trained exactly as it
was sampled, from the weights it was sampled from? One live cell, graded check by check.

- ``checks.py``: the checks read from a run's captures, flows and trajectories (capture, exact
  history, mask, sampling, tool calls, reasoning), each with its measured number and minimum count;
- ``delivery.py``: the two that need the trainer or the server (logprob agreement, policy delivery);
- ``runner.py``: one cell, live, on the loop's own machinery (``LocalPlacement``);
- ``report.py``: the readable table and the exit status;
- ``matrix.py``: the published matrix, generated from committed results into docs/certify.md;
- ``commands.py``: the ``polar certify`` command (cells, shards, resume, publish).
"""
