"""Captures -> lazy Polars frames -> trajectories: ``frames``, ``alignment`` (re-rendering with the
chat template), ``drift`` (why a prompt is not the previous one + its answer), ``trajectories/``
(one module per mode), ``rewards``, ``synthetic`` (captures for tests), ``commands`` (the ``polar``
commands). Imports nothing of Polar's but ``polar_core``.
"""
