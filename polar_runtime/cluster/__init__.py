"""Past one machine: the loop's Ray placement (``[placement] kind = "ray"``, docs/cluster.md).

- ``agent.py``: :class:`NodeAgent`, one per node: that node's proxy, harness runs and sandboxes,
  captures in a node-local directory; finished samples leave the node as plain data (rows, token ids,
  logprobs, policy versions, rewards), one at a time, so a node lost mid-group loses none of them;
- ``replicas.py``: :class:`VLLMReplica`, a vLLM server owned by an actor, reloaded in place and
  verified on its own node; or URLs of servers the user runs;
- ``trainer.py``: :class:`TrainerHost`, the persistent trainer (``polar_training.session``) on a
  Ray placement group;
- ``dispatch.py``: which node runs a group, and what happens when a node is lost (retry elsewhere);
- ``placement.py``: :class:`RayPlacement`, the loop's ``Placement`` made of the above;
- ``gather.py`` + ``commands.py``: ``polar cluster gather``, every node's captures copied into one
  directory, one folder per node.

Nothing here is imported by ``import polar_runtime`` or by the local placement, and only
``placement.py``, ``dispatch.py``, ``gather.py`` and ``commands.py`` import ``ray`` (inside
functions or when they are imported themselves): one machine never needs Ray.
"""
