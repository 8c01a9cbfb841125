"""A prefill-side NIXL peer in its own process, for tests/test_nixl_transport.py.

Run as ``python tests/nixl_peer.py FD NAME SEED NUM_BLOCKS LAYERS KV_HEADS BLOCK_SIZE HEAD_SIZE``:
builds vLLM-CPU-layout KV caches (``[num_blocks, kv_heads, block_size,
2*head_size]`` float32 per layer) filled with ``pattern(SEED, ...)``, wraps
them in a ``NixlTransport`` named NAME, and serves commands over the
``multiprocessing.connection.Connection`` on file descriptor FD (msgpack
dicts). Between commands it polls ``get_notifs`` (as the event loop would)
and keeps what arrives.

Commands: ``overwrite`` (fill one block of every layer with a byte),
``add_peer`` (metadata), ``send_notif`` (peer, msg), ``wait_notifs`` (n,
within: reply once n notifications arrived or the time is up), ``exit``.
"""

from __future__ import annotations

import os
import sys
import time
from multiprocessing.connection import Connection

import msgspec
import numpy as np


def pattern(seed: int, num_layers: int, shape: tuple[int, ...]) -> np.ndarray:
    """The bytes layer ``l`` of a cache filled with ``seed`` holds: ``[layers, *shape]`` uint32."""
    return np.random.default_rng(seed).integers(0, 2**32, size=(num_layers, *shape), dtype=np.uint32)


def make_caches(seed: int, num_blocks: int, layers: int, kv_heads: int, block_size: int,
                head_size: int):
    """Per-layer KV caches in vLLM-CPU's layout, filled with ``pattern(seed)``."""
    import torch

    shape = (num_blocks, kv_heads, block_size, 2 * head_size)
    pat = pattern(seed, layers, shape)
    caches = {}
    for i in range(layers):
        t = torch.empty(shape, dtype=torch.float32)
        t.view(torch.int32).numpy()[...] = pat[i].view(np.int32)
        caches[f"model.layers.{i}.self_attn.attn"] = t
    return caches


def main(argv: list[str]) -> int:
    fd, name, seed, num_blocks, layers, kv_heads, block_size, head_size = argv
    conn = Connection(int(fd))
    from kvsm.transport.layout import describe_kv_caches
    from kvsm.transport.nixl import NixlTransport

    caches = make_caches(int(seed), int(num_blocks), int(layers), int(kv_heads), int(block_size),
                         int(head_size))
    layout = describe_kv_caches(caches, num_blocks=int(num_blocks))
    transport = NixlTransport(name, layout)
    conn.send_bytes(msgspec.msgpack.encode({"metadata": transport.metadata(), "pid": os.getpid()}))
    notifs: list[tuple[str, bytes]] = []
    try:
        while True:
            notifs.extend(transport.get_notifs())
            if not conn.poll(0.002):
                continue
            try:
                cmd = msgspec.msgpack.decode(conn.recv_bytes())
            except EOFError:  # the test process is gone: do not outlive it
                break
            op = cmd["op"]
            reply: dict = {"ok": True}
            if op == "overwrite":
                for t in caches.values():
                    t[cmd["block"]].view(torch_uint8()).fill_(cmd["byte"])
            elif op == "add_peer":
                reply["peer"] = transport.add_peer(cmd["metadata"])
            elif op == "send_notif":
                reply["sent"] = transport.send_notif(cmd["peer"], cmd["msg"])
            elif op == "wait_notifs":
                deadline = time.monotonic() + cmd["within"]
                while len(notifs) < cmd["n"] and time.monotonic() < deadline:
                    notifs.extend(transport.get_notifs())
                    time.sleep(0.001)
                reply["notifs"] = [list(n) for n in notifs]
                notifs.clear()
            elif op == "exit":
                conn.send_bytes(msgspec.msgpack.encode(reply))
                break
            else:
                reply = {"ok": False, "error": f"unknown op {op!r}"}
            conn.send_bytes(msgspec.msgpack.encode(reply))
    finally:
        transport.close()
    return 0


def torch_uint8():
    import torch

    return torch.uint8


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
