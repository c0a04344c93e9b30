"""The payload checksum (``SHMLOADER_VERIFY``): CRC-32 of a slot's payload, and its check.

Owns the one checksum every writer stamps and every reader checks; pure, no I/O.
"""

from __future__ import annotations

import zlib

import numpy as np

from ..errors import ProtocolError


def payload_crc(payload: np.ndarray) -> int:
    return zlib.crc32(payload)  # type: ignore[arg-type]  # numpy types __buffer__ from 3.12


def check_payload_crc(payload: np.ndarray, expected: int, seq: int) -> None:
    got = payload_crc(payload)
    if got != expected:
        raise ProtocolError(
            f"batch {seq}: payload CRC-32 {got:08x} != {expected:08x} announced by the writer; "
            "the shared memory was modified or corrupted between write and read"
        )
