"""The live-recovery transfer: a healthy replica serves its state over HTTP, weights only."""

from __future__ import annotations

import urllib.request
from datetime import timedelta

from torch.distributed._serialization import _streaming_load
from torchft.checkpointing.http_transport import HTTPTransport


class WeightsOnlyHTTPTransport(HTTPTransport[dict[str, object]]):
    """torchft's HTTP transport, reading what a peer sends with the weights-only unpickler.

    The stock transport unpickles the peer's stream with `weights_only=False`, so a peer (or
    anything that answers on its port) could run code in the recovering process. What a
    replica sends is tensors, numbers, strings and containers of them: the model, AdamW and
    LambdaLR state and torchft's step counters, all of which the weights-only unpickler reads.
    """

    def __init__(self, timeout: timedelta) -> None:
        super().__init__(timeout=timeout, num_chunks=0)  # one stream: the whole state

    @classmethod
    def _load_from_address(cls, address: str, timeout: timedelta) -> object:
        with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
            return _streaming_load(f, weights_only=True)
