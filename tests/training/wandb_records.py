"""Read back what an offline wandb run stored: the history rows of its ``.wandb`` file.

The file is wandb's transaction log: a 7-byte header (":W&B", magic 0xBEE1, version 0), then
32 KiB blocks of records, each a 7-byte header (CRC-32 seeded with the record type, length, type:
full / first / middle / last piece) and a piece of a serialized ``wandb.proto`` ``Record``. wandb
0.31 parses it only in its Go core, so the tests read it here with wandb's own protobuf classes.

``run.finish()`` can return before wandb-core closes the log: its writer buffers a block and writes
it only when the block fills or the log closes, so a small run's file may still hold only its
header. Readers therefore wait for the closing ``exit`` record.
"""

from __future__ import annotations

import json
import struct
import time
import zlib
from pathlib import Path

from wandb.proto import wandb_internal_pb2

_BLOCK = 32768
_HEADER = struct.Struct("<IHB")
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _payloads(data: bytes) -> list[bytes]:
    ident, magic, version = struct.unpack_from("<4sHB", data)
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), "not a wandb transaction log"
    payloads, pending, offset = [], b"", 7
    while offset + _HEADER.size <= len(data):
        if _BLOCK - offset % _BLOCK < _HEADER.size:  # the rest of a block too short for a header is padding
            offset += _BLOCK - offset % _BLOCK
            continue
        checksum, length, kind = _HEADER.unpack_from(data, offset)
        if kind == 0 and length == 0:
            break
        piece = data[offset + _HEADER.size : offset + _HEADER.size + length]
        assert zlib.crc32(piece, zlib.crc32(bytes([kind]))) == checksum, f"corrupt record at byte {offset}"
        offset += _HEADER.size + length
        pending = piece if kind in (_FULL, _FIRST) else pending + piece
        if kind in (_FULL, _LAST):
            payloads.append(pending)
    return payloads


def _parse(data: bytes) -> list[wandb_internal_pb2.Record]:
    records = []
    for payload in _payloads(data):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        records.append(record)
    return records


def _records(path: Path, timeout: float) -> list[wandb_internal_pb2.Record]:
    """The records of a finished run's log, waiting up to ``timeout`` s for wandb-core to close it."""
    deadline = time.monotonic() + timeout
    while True:
        data = path.read_bytes()
        try:
            records, problem = _parse(data), ""
        except (AssertionError, struct.error) as error:  # caught mid-write: look again
            records, problem = [], str(error)
        if records and records[-1].WhichOneof("record_type") == "exit":
            return records
        if time.monotonic() > deadline:
            kinds = [record.WhichOneof("record_type") for record in records]
            raise AssertionError(f"wandb-core left {path} unclosed after {timeout} s: {len(data)} bytes, records {kinds} {problem}")
        time.sleep(0.05)


def history_rows(run_dir: str | Path, timeout: float = 60.0) -> list[dict]:
    """Every history row (one per ``run.log`` call) of the single offline run under ``run_dir/wandb``."""
    files = list(Path(run_dir).glob("wandb/offline-run-*/*.wandb"))
    assert len(files) == 1, files
    return [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        for record in _records(files[0], timeout)
        if record.WhichOneof("record_type") == "history"
    ]
