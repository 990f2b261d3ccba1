"""Tools for Polar's tests and benchmarks, never used by the product itself.

``listeners``: a loopback listener that counts connections (isolation tests).

``proxies``: a capturing proxy in exact-history mode for a test module.

``scripted_upstream``: an inference server in vLLM's wire format (token ids, logprobs, SSE framing)
that answers from a script, so the proxy can be tested and benchmarked without a model. Run it
as ``python -m polar_testing.scripted_upstream --port N``.
"""
