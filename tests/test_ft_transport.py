"""The live-recovery transfer reads a peer's state with the weights-only unpickler: a stream
that would run code when unpickled is refused, where torchft's stock transport runs it."""

from __future__ import annotations

import http.server
import io
import pickle
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch.distributed._serialization import _streaming_save
from torchft.checkpointing.http_transport import HTTPTransport

from checkpoints import RunsCode
from reference_impl.ft.transport import WeightsOnlyHTTPTransport

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def serving(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """An HTTP address that answers with a state whose unpickling would create `marker`."""
    marker = tmp_path / "code-ran"
    buffer = io.BytesIO()
    _streaming_save({"step": 3, "w": torch.ones(2), "payload": RunsCode(str(marker))}, buffer,
                    pickle_module=pickle)
    body = buffer.getvalue()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the server's name for it
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/checkpoint/3", marker
    finally:
        server.shutdown()


def test_a_peer_stream_that_runs_code_is_refused(serving: tuple[str, Path]) -> None:
    address, marker = serving
    with pytest.raises(pickle.UnpicklingError):
        WeightsOnlyHTTPTransport._load_from_address(address, timedelta(seconds=10))
    assert not marker.exists(), "the peer's pickle must never run"


def test_torchfts_own_transport_would_run_it(serving: tuple[str, Path]) -> None:
    """Why the subclass exists: the stock transport unpickles with weights_only=False."""
    address, marker = serving
    HTTPTransport._load_from_address(address, timedelta(seconds=10))
    assert marker.exists()
