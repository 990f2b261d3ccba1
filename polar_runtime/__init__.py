"""The top layer: the ``polar`` CLI (``cli``), offline models (``models``), the vLLM server
(``serve``), harness presets (``harnesses``), the rollout runner (``rollout``) and the demo (``demo``):
the one place that wires the proxy, the analysis and the trainer together.

``lenient_tool_parser.py`` is not imported by Polar: vLLM loads it by path, in its own venv.
"""
