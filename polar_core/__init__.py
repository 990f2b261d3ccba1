"""What every area of Polar shares, and nothing else: the bottom layer.

Modules: ``schema`` (the capture record and trajectory columns, session ids, the harness field),
``paths`` (the cache home, POLAR_HOME, where models live), ``processes`` (process groups, a
cross-process file lock), ``net`` (free ports, the no-proxy HTTP JSON client), ``control`` (the
client of the proxy's ``/_polar`` control API), ``flowmeta`` (what a saved flow of a model call carries in
``flow.metadata["polar"]``).

It imports nothing of Polar's own; the proxy (``polar_proxy``), the analysis (``polar_analysis``),
the trainer (``polar_training``) and the runtime (``polar_runtime``) all import it.
"""
