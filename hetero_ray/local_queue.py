"""A Ray queue whose actor lives on the caller's own node."""

from __future__ import annotations

import ray
from ray.util.queue import Queue
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


def local_queue() -> Queue:
    """A ``ray.util.queue.Queue`` held on the node this process runs on.

    Ray places an actor that asks for no CPU on any node, and a lost node takes its actors with it: a
    progress queue placed on a GPU node would end the run's reader when that node goes, though the run
    itself re-plans and goes on. The reader's own node is one it cannot outlive anyway.
    """
    node = ray.get_runtime_context().get_node_id()
    return Queue(actor_options={"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)})
