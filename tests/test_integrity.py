"""Checkpoint checksums (reference_impl.checkpoint.integrity): any flipped byte is caught, old sha256
manifests still verify, and a malformed entry is never taken for a checksum."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import pytest
import xxhash

from reference_impl.checkpoint import integrity


@pytest.fixture
def payload(tmp_path: Path) -> Path:
    path = tmp_path / "train.pt"
    path.write_bytes(random.Random(0).randbytes(3 * 4096 + 17))  # not a whole number of pages
    return path


def test_a_flipped_bit_anywhere_is_detected(payload: Path) -> None:
    entry = integrity.digest_file(payload)
    assert integrity.mismatch(payload, entry) is None
    data = bytearray(payload.read_bytes())
    for position in [0, len(data) - 1, *random.Random(1).sample(range(len(data)), 40)]:
        data[position] ^= 0x10
        payload.write_bytes(bytes(data))
        assert "xxh3_128 check" in integrity.mismatch(payload, entry), f"byte {position}"
        data[position] ^= 0x10
    payload.write_bytes(bytes(data)[:-1])
    assert "bytes" in integrity.mismatch(payload, entry), "a truncated file is caught by its size"


def test_manifests_written_with_sha256_still_verify(payload: Path) -> None:
    legacy = {"sha256": hashlib.sha256(payload.read_bytes()).hexdigest(), "bytes": payload.stat().st_size}
    assert integrity.mismatch(payload, legacy) is None
    payload.write_bytes(b"x" + payload.read_bytes()[1:])
    assert "sha256 check" in integrity.mismatch(payload, legacy)


def test_the_entry_is_the_xxh3_128_of_every_byte(payload: Path) -> None:
    data = payload.read_bytes()
    assert integrity.digest_file(payload) == {"xxh3_128": xxhash.xxh3_128(data).hexdigest(), "bytes": len(data)}


@pytest.mark.parametrize("entry", [
    None, [], {"bytes": 1}, {"xxh3_128": "0" * 32}, {"xxh3_128": "0" * 31, "bytes": 1},
    {"xxh3_128": "Z" * 32, "bytes": 1}, {"xxh3_128": "0" * 32, "bytes": -1},
    {"xxh3_128": "0" * 32, "bytes": True}, {"xxh3_128": "0" * 32, "sha256": "0" * 64, "bytes": 1},
    {"md5": "0" * 32, "bytes": 1},
])
def test_a_malformed_entry_names_no_algorithm(entry: object, payload: Path) -> None:
    assert integrity.algorithm_of(entry) is None
    assert "no known checksum" in integrity.mismatch(payload, entry)  # type: ignore[arg-type]
