"""The coordinator's wire format: one JSON object per line, each way.

Every connection opens with ``{"op": "hello", "token": ...}``; the token is
``HEMIOLA_JOB_TOKEN`` (empty when unset), and a coordinator started with one
refuses connections that do not present it. Binary values (the engines'
rendezvous keys) travel base64-coded. A line is at most ``MAX_LINE`` bytes:
a longer one is refused, so a stray client cannot make the coordinator hold
unbounded memory.
"""

from __future__ import annotations

import base64
import json
import socket
from typing import Any

#: the longest message either side accepts (a rendezvous value is < 1 KiB)
MAX_LINE = 1 << 20


class ProtocolError(RuntimeError):
    """A peer sent something that is not a coordinator message."""


def send(sock: socket.socket, message: dict[str, Any]) -> None:
    """Writes one message."""
    sock.sendall(json.dumps(message, separators=(",", ":")).encode() + b"\n")


def receive(reader: Any, request: bool = True) -> dict[str, Any] | None:
    """Reads one message from a binary file over the socket (``makefile("rb")``);
    None when the peer closed the connection. A request names its ``op``."""
    line = reader.readline(MAX_LINE + 1)
    if not line:
        return None
    if len(line) > MAX_LINE or not line.endswith(b"\n"):
        raise ProtocolError(f"a message longer than {MAX_LINE} bytes, or cut off")
    try:
        message = json.loads(line)
    except ValueError as e:
        raise ProtocolError(f"not a JSON message: {e}") from None
    if not isinstance(message, dict):
        raise ProtocolError("a message is a JSON object")
    if request and not isinstance(message.get("op"), str):
        raise ProtocolError("a request is a JSON object with a string 'op'")
    return message


def encode(value: bytes) -> str:
    return base64.b64encode(value).decode()


def decode(value: str) -> bytes:
    return base64.b64decode(value.encode(), validate=True)
