"""A local multi-node Ray cluster on one machine, for trying the Ray placement (docs/cluster.md).

``python -m polar_testing.ray_cluster --nodes 2`` starts a head (``--head-cpus``, the trainer's
placement group lands there) and N nodes with the custom resource ``polar_rollout`` (node agents
and vLLM replicas land there, one per node: ``[placement] node_resource = "polar_rollout"``),
prints the address and the node ids, then reads commands on stdin: ``remove I`` removes node I
(its raylet and every actor on it die, as when a machine is lost), ``list``, ``quit``.
``ray start`` runs one raylet per machine; ``ray.cluster_utils.Cluster`` is Ray's own tool for
several on one machine (the one its tests use).
"""

from __future__ import annotations

import argparse
import sys


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--node-cpus", type=int, default=1)
    ap.add_argument("--head-cpus", type=int, default=1)
    ap.add_argument("--resource", default="polar_rollout")
    args = ap.parse_args()
    from ray.cluster_utils import Cluster

    cl = Cluster(initialize_head=True, head_node_args={"num_cpus": args.head_cpus, "include_dashboard": False})
    nodes = [cl.add_node(num_cpus=args.node_cpus, resources={args.resource: 1}) for _ in range(args.nodes)]
    cl.wait_for_nodes()
    print(f"address: {cl.address}", flush=True)
    try:
        for i, n in enumerate(nodes):
            print(f"node {i}: {n.node_id}", flush=True)
        for line in sys.stdin:
            cmd = line.split()
            if not cmd:
                continue
            if cmd[0] == "remove" and len(cmd) == 2 and cmd[1].isdigit() and int(cmd[1]) < len(nodes):
                cl.remove_node(nodes[int(cmd[1])])
                print(f"removed node {cmd[1]}: {nodes[int(cmd[1])].node_id}", flush=True)
            elif cmd[0] == "list":
                for i, n in enumerate(nodes):
                    print(f"node {i}: {n.node_id} {'alive' if n in cl.worker_nodes else 'removed'}", flush=True)
            elif cmd[0] == "quit":
                break
            else:
                print("commands: remove I | list | quit", flush=True)
    finally:
        cl.shutdown()


if __name__ == "__main__":
    main()
