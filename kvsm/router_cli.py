"""The router's command line (``python -m kvsm.router``): its flags, checked
(``kvsm.router.main`` serves what they ask for)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from kvsm.router_stream import TRANSFER_MODES, mode_conflict

__all__ = ["DEFAULT_DISAGG_THRESHOLD", "parse_args"]

# --disagg-threshold's default: off, so an upgraded router sends requests where it always
# did; 64 is the setting measured for the dev machine (docs/benchmarks.md, "Selective
# disaggregation"), to be measured again once first-token seeding cuts the P/D cost.
DEFAULT_DISAGG_THRESHOLD = 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The flags of ``argv`` (the process's when None); a bad one exits, naming it."""
    parser = argparse.ArgumentParser(prog="python -m kvsm.router",
                                     description="Route OpenAI completion requests to a prefill, then a decode vLLM "
                                     "backend (disaggregated serving, pull mode).")
    parser.add_argument("--prefill", action="append", required=True, metavar="URL",
                        help="a prefill backend (vLLM with a KV connector, kv_role kv_producer or kv_both); "
                             "repeat for more")
    parser.add_argument("--decode", action="append", required=True, metavar="URL",
                        help="a decode backend (kv_role kv_consumer or kv_both); repeat for more")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds a backend may take to connect or stay silent (default 300) before a 504")
    parser.add_argument("--disagg-threshold", type=int, default=DEFAULT_DISAGG_THRESHOLD, metavar="TOKENS",
                        help="a prompt with fewer uncached tokens on its decode backend than this goes to the decode "
                             f"backend alone, without prefill (default {DEFAULT_DISAGG_THRESHOLD}; 0: every request "
                             "by prefill and transfer)")
    parser.add_argument("--prefix-block-size", type=int, default=16, metavar="TOKENS",
                        help="tokens per block of the router's prefix index: the engines' --block-size (default 16)")
    parser.add_argument("--prefix-affinity", action="store_true",
                        help="send each request to the prefill and the decode backend holding the longest prefix of "
                             "its prompt (text and chat counted by a decode backend's /tokenize); default: round robin")
    parser.add_argument("--affinity-max-inflight", type=int, default=None, metavar="N",
                        help="with --prefix-affinity, a preferred backend with more than N requests in flight gives "
                             "way to the least loaded (default: twice the least loaded backend's count, plus 4)")
    parser.add_argument("--first-token-seeding", action="store_true",
                        help="stream a streamed request's first token from the prefill leg's answer at once, the "
                             "decode engine's stream after it (one choice; see kvsm.router_seeding); default: the "
                             "first token comes from the decode engine")
    parser.add_argument("--reuse-holds", action="store_true",
                        help="learn the blocks decode engines hold for a conversation's next turn (bidirectional_kv_"
                             "xfer) and have each P/D prompt's prefill leg read the longest it starts with (see "
                             "kvsm.router_holds); default: only holds the client passes in kv_transfer_params")
    parser.add_argument("--transfer-mode", choices=TRANSFER_MODES, default=None,
                        help="how the prefill engine hands the KV over, set in its leg's kv_transfer_params: pull, "
                             "push, or stream (both legs at once, the prefill engine writing each layer as it computes "
                             "it; kvsm engines on both sides; see kvsm.router_stream); default: the engines' setting")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    if args.disagg_threshold < 0 or args.prefix_block_size < 1 or (args.affinity_max_inflight or 0) < 0:
        parser.error("--disagg-threshold and --affinity-max-inflight must be 0 or more, --prefix-block-size 1 or more")
    conflict = mode_conflict(args.transfer_mode, args.first_token_seeding, args.reuse_holds)
    if conflict:
        parser.error(conflict)
    return args
