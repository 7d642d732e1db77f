"""A model as Ray tasks and actors receive it: the spec's reference, never the driver's
directory. Each worker resolves it on its own node (`lorp.models.loading.materialize`):

- a packaged alias or a .gguf file is converted on that node, into its own cache;
- a hub id is downloaded at the commit the driver resolved once (`revision`), so a
  later push to the repository cannot give two nodes different weights;
- a local directory is used as it is: it must exist on every node that loads it (a
  shared filesystem), and a node without it fails with one line naming the path and
  the node.

Whatever the route, `load_checked` refuses weights whose content fingerprint is not the
one the driver planned with.
"""

from __future__ import annotations

import dataclasses
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorp.models.loading import Kind, ModelRef, materialize


@dataclass(frozen=True)
class ModelSource:
    """What to load and how, as plain data."""

    ref: str
    """The reference as the driver parsed it: alias, hub id, local directory or .gguf."""
    kind: Kind
    revision: str | None = None
    """The hub commit every node downloads (hub ids only)."""
    fingerprint: str = ""
    """The content fingerprint the driver planned with ("" skips the check)."""
    dtype: str = "float32"
    trust_remote_code: bool = False
    allow_pickle: bool = False
    label: str = ""
    """The job's name for the model (timeline spans, log lines); not part of loading."""
    streamed: bool = False
    """Blocks read from the files one at a time (`lorp.models.streaming`): the plan found the
    model too large for this stage's workers to hold whole."""
    pristine: bool = True
    """A CPU grid worker may keep the model it loaded and copy it per point; false where
    the plan found room for one copy only (then every point loads its own)."""


def node_name() -> str:
    """This node, as an error message names it: host name and Ray node address."""
    try:
        import ray

        return f"{socket.gethostname()} ({ray.util.get_node_ip_address()})"
    except Exception:  # outside Ray: the host name says enough
        return socket.gethostname()


def model_dir(source: ModelSource) -> Path:
    """The model's local directory on this node (converted or downloaded here if needed)."""
    if source.kind in ("dir", "gguf") and not Path(source.ref).exists():
        raise FileNotFoundError(
            f"model {source.ref!r} is not on node {node_name()}: a local model path must "
            "exist on every node that loads it (use shared storage, a hub id or an alias)"
        )
    ref = ModelRef(source.ref, source.kind)
    return materialize(ref, allow_pickle=source.allow_pickle, revision=source.revision)


def load_checked(source: ModelSource, device: str, head: bool = True, tokenizer: Any = True) -> Any:
    """`load_model` on this node, refusing weights other than the ones the driver planned
    with. `head=False`: a streamed model without its LM head (capture workers);
    `tokenizer`: load the model's (True), or this one, loaded already."""
    from lorp.models.loading import load_model

    path = model_dir(source)
    lm = load_model(
        str(path),
        dtype=source.dtype,
        device=device,
        trust_remote_code=source.trust_remote_code,
        allow_pickle=source.allow_pickle,
        streamed=source.streamed,
        head=head,
        with_tokenizer=tokenizer is True,
    )
    if tokenizer is not True:
        lm = dataclasses.replace(lm, tokenizer=tokenizer)
    if source.fingerprint and lm.fingerprint != source.fingerprint:
        raise ValueError(
            f"model {source.ref!r} on node {node_name()} has fingerprint {lm.fingerprint}, "
            f"the driver planned with {source.fingerprint}"
        )
    return lm
