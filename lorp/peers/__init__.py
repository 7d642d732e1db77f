"""The published recipes lorp is compared with, each selection paired with its own repair
as its paper pairs them (issue #76): ReplaceMe's cosine map, LinearPatch, Prune&Comp and
LLM-Streamline's replacement layer. Importing this package registers their selections
(`lorp.methods.registry`, flag `peer`); `lorp.peers.recipes.repair_peer` runs the repair
a peer's selection is paired with.
"""

from lorp.peers import linear_patch, prune_and_comp, replaceme, streamline_layer  # noqa: F401
from lorp.peers.recipes import PEER_REPAIRS, PeerRepair, repair_peer

__all__ = ["PEER_REPAIRS", "PeerRepair", "repair_peer"]
