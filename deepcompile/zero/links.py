"""Which communicator carries which collective: the schedule report's ``links`` section.

The runtime has up to three communicators (docs/design/hybrid_sharding.md, docs/design/hpz.md):
``shard`` (the world, or the shard group under hybrid sharding), ``replica`` (hybrid sharding:
the all-reduce of each reduced gradient partition) and ``secondary`` (hpZ: gathers that read the
node-local secondary copies). This names, per link, its ranks and what it carries, and per graph
of the report which link its gathers use, so a report says where each byte goes; the byte
counts themselves are per step, in ``engine.step_report.comm_bytes``.
"""

from __future__ import annotations

from typing import Any, Dict

from deepcompile import runtime
from deepcompile.zero.topology import ShardTopology


class LinkReport:
    """A schedule report contributor (scheduling/report.py): adds ``links`` and, to every graph
    of the plan, ``gather_link``."""

    name = "links"

    def __init__(self, topology: ShardTopology, stage: int):
        self.topology = topology
        self.stage = stage

    def links(self) -> Dict[str, Any]:
        t = self.topology
        shard = ["gradient reduce-scatters" if self.stage == 3 else "gradient reduces to each range's owner"]
        if self.stage == 3:
            shard.insert(0, "parameter gathers" + (" that read the primary shards (the first of each parameter "
                                                   "after an optimizer step)" if t.hpz else ""))
        out: Dict[str, Any] = {"shard": {"ranks": t.shard_size, "carries": shard}}
        if t.hybrid:
            out["replica"] = {"ranks": t.replicas, "carries": ["all-reduce of each reduced gradient partition"]}
        if t.hpz:
            out["secondary"] = {"ranks": t.secondary_size,
                                "carries": ["parameter gathers that read a current secondary copy (the backward's, "
                                            "and later micro-steps' forwards)"],
                                "secondary_copy_bytes": runtime.secondary_bytes()}
        return out

    def gather_link(self, phase: str) -> str:
        """The link a graph's parameter gathers use, by the graph's phase."""
        if not self.topology.hpz:
            return "shard"
        # A forward graph's first run after a step reads the shards; its later runs in the same
        # step (gradient accumulation) and every backward gather read the secondary copies.
        return "secondary" if phase == "backward" else "shard, then secondary until the next step"

    def report(self, into: Dict[str, Any]) -> None:
        into["links"] = self.links()
        if self.stage == 3:
            for graph in into.get("graphs", []):
                graph["gather_link"] = self.gather_link(graph.get("phase", "forward"))
