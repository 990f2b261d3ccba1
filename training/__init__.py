"""Polar's GRPO trainer: learns from captured trajectories and pushes the weights back to vLLM.

Modules: ``config`` (every setting and its default), ``advantages`` (group-relative advantages,
Polars), ``loss`` (PPO-clip + TIS + k3 KL), ``packing`` (first-fit-decreasing token-budget
micro-batches), ``policy`` (chunked sampled-token logprobs), ``trainer`` (the loop),
``distributed`` (FSDP2 under torchrun; ``parity`` checks it), ``checkpoint``, ``weights_push``
(pause proxies -> reload every vLLM replica -> new policy version; ``push_probe``: the check that
the served weights are the new ones), ``run`` / ``commands`` (``polar train``,
``python -m polar_training``), ``plots``, ``toy`` (a torch-sampled toy task for learning checks).
Heavy dependencies (torch, transformers) are imported by those modules, not here.
"""
