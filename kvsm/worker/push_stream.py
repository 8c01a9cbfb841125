"""Streamed push, prefill side: each layer's KV goes into the decode worker's
blocks as soon as that layer's forward pass is done.

The router sends both legs at once with one join key. The decode worker
claims the request by that key and asks for the writes (a ``WriteSpec`` with
``stream``: its blocks by position, no source blocks); the scheduler half
tells this worker, step by step, which tokens of which streamed request a step
computes and in which blocks (``StreamStep``). vLLM calls ``save_kv_layer``
after each attention layer and ``wait_for_save`` after the forward pass: both
only post to the loop (``layer_saved``, ``step_over``), which posts one NIXL
WRITE per layer of the blocks the step filled. The prompt's very last layer
waits a moment (``LAST_LAYER_HANDOFF_S`` at most) for the loop to have posted
its write, so that the loop need not wait for the interpreter behind the
model. An ask that comes late (the prefill under way or over) first writes
what is computed already.

The decode worker hears of the end by the notification the last write
carries: posted only once every earlier write is over (NIXL orders a write's
notification after that write's bytes, not after other writes'), so when the
last layer of the last step is done, only its own write is left. A last write
that had to go out while others were in flight goes without; the notification
follows alone once every write is over (a ticker looks every 250 µs). A write that
fails, a deadline that passes, blocks freed under the writes: the decode rank
is told (``failed``: nothing in flight; ``cancelled``: bytes may still land,
so it waits for its deadline), as for push mode's whole write.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from typing import Any

from kvsm.handoff.facts import UNWRITTEN, SendStart, StreamPreempted, StreamStep
from kvsm.handshake.messages import WriteAsk, WriteSpec
from kvsm.lifecycle import events as ev
from kvsm.lifecycle.folds import LEASE_MARGIN_NS
from kvsm.lifecycle.machine import Outcome
from kvsm.lifecycle.table import ANSWER_OK, ANSWER_UNKNOWN
from kvsm.transport.base import TransferState
from kvsm.worker.context import WorkerContext
from kvsm.worker.push_notif import Drains
from kvsm.worker.runner import Effect
from kvsm.worker.stream_state import Progress, Stream, complete, dst_rows, pair_rows
from kvsm.worker.ticker import STREAM_POLL_S, PollTicker

# The model thread hands the loop the last layer of a streamed prompt's last step
# and waits, this long at most, for the loop to have posted that layer's write.
# Only posting, the loop thread waited for the interpreter behind the model thread:
# the write went out 0.4-1.9 ms after the layer on the prefill engine's busy core,
# 0.41-0.56 ms with the hand-off (docs/benchmarks.md section 11).
LAST_LAYER_HANDOFF_S = 0.005


class Streamer:
    """The sending part's streamed writes."""

    def __init__(self, ctx: WorkerContext, drains: Drains) -> None:
        self.ctx = ctx
        self.drains = drains
        self.loop = ctx.loop
        self._apply_send = ctx.apply_send
        self.keys: dict[str, str] = {}  # join key -> our request
        self.progress: dict[str, Progress] = {}
        self.streams: dict[str, dict[str, Stream]] = {}  # request -> decode rank -> its stream
        self._step_reqs: list[str] = []
        self._index: dict[str, int] | None = None
        self._groups: tuple[int, ...] = ()  # per layer, its KV cache group
        # Model thread only: whether this step computes a streamed request (and the
        # last tokens of one: ``_final``), and how many of its layers were saved.
        self._stepping = False
        self._final = False
        self._saved = 0
        # Streams whose every layer is posted but whose notification waits for the earlier
        # writes to be over: checked every STREAM_POLL_S by a ticker while there are any.
        self._finals_due: set[tuple[str, str]] = set()
        self._ticker: PollTicker | None = None
        self.effects: dict[str, Effect] = {"start_stream": self._start_stream, "pass_abandon": self._pass_abandon,
                                           "restart_stream": self._restart_stream,
                                           "rewrite_unsure_streams": self._rewrite_unsure_streams,
                                           "fail_notified_streams": self._fail_notified_streams}

    def busy(self) -> bool:
        return bool(self.streams)

    @property
    def layers(self) -> dict[str, int]:
        if self._index is None:
            transport = self.ctx.transport
            names = transport.layers() if transport is not None else None
            self._index = {name: i for i, name in enumerate(names or ())}
            self._groups = transport.layer_groups() if transport is not None else ()
        return self._index

    # -- the model thread: posts only (the very last layer: waits for its post) --------------

    def stepping(self, on: bool, final: bool = False) -> None:
        self._stepping, self._final, self._saved = on, on and final, 0

    def layer_saved(self, layer: str) -> None:
        if not self._stepping:
            return
        item = (layer, self.loop.now_ns())
        self._saved += layer in self.layers
        if self._final and self._saved == len(self.layers):  # (the forward pass's last, whatever its name)
            # The handover's tail starts now: let the loop post this write at once.
            posted = threading.Event()
            self.loop.post(partial(self._layer_then_set, item, posted), label="stream last layer")
            posted.wait(LAST_LAYER_HANDOFF_S)
            return
        self.loop.post(partial(self._guarded, self._on_layer, item), label="stream layer")

    def step_over(self) -> None:
        if self._stepping:
            self._stepping = self._final = False
            self.loop.post(partial(self._guarded, self._on_step_over, None), label="stream step over")

    def _guarded(self, fn: Callable[[Any], object], arg: Any) -> None:
        self.ctx.guard(None, fn, arg)

    def _layer_then_set(self, item: tuple[str, int], posted: threading.Event) -> None:
        try:
            self._guarded(self._on_layer, item)
        finally:
            posted.set()

    # -- the loop: what the scheduler says ---------------------------------------------------

    def on_step(self, starts: list[SendStart], steps: list[StreamStep],
                preempted: list[StreamPreempted] | tuple[()] = ()) -> None:
        for gone in preempted:
            self._preempted(gone)
        for s in starts:
            if s.stream:
                self.keys[s.stream] = s.req
                self.progress.setdefault(s.req, Progress(s.stream))
                self.ctx.note("worker.stream_key", s.req, key=s.stream)  # (replay joins the two sides by it)
                if s.stream in self.ctx.send:  # an input by the key came before the key was known here
                    self._apply_send(ev.StreamJoined(req=s.stream, joined=s.req))
        self._step_reqs = []
        for st in steps:
            p = self.progress.get(st.req)
            if p is None:
                self.ctx.note("worker.stream_step_unknown", st.req)
                continue
            # Tokens before this step are computed: by an earlier step or the prefix cache.
            p.done = max(p.done, p.end, st.start)
            p.blocks, p.start, p.end, p.last = st.block_ids, st.start, st.end, st.last
            p.upto = [max(u, p.done) for u in p.upto] if len(p.upto) == len(self.layers) else (
                [p.done] * len(self.layers))
            p.steps += 1
            self._step_reqs.append(st.req)

    def _preempted(self, gone: StreamPreempted) -> None:
        """vLLM preempted the request and freed its blocks: the send table decides
        (``stream_preempted``), told which decode ranks had a write not seen over
        before the free (it may have read bytes another request computed into them)."""
        if gone.req not in self.progress:
            return
        unsure, notified = [], []
        for reader, w in list(self.streams.get(gone.req, {}).items()):
            settled = self._settled(gone.req, reader, w)
            if self.streams.get(gone.req, {}).get(reader) is not w:
                continue  # a write had failed: failed already
            if not settled or w.final is not None or w.seen_over_ns >= gone.at_ns:
                unsure.append(reader)
                if w.final is not None:
                    notified.append(reader)
        if gone.req in self.ctx.send:
            self._apply_send(ev.StreamPreempted(req=gone.req, at_ns=gone.at_ns, unsure=tuple(unsure),
                                                notified=tuple(notified)))
        else:
            self._restart(gone.req)

    def _restart_stream(self, req: str, o: Outcome) -> None:
        self._restart(req)

    def _restart(self, req: str) -> None:
        """What the request computes again goes from its new blocks; the tokens
        written before stay (the same KV)."""
        p = self.progress.get(req)
        if p is not None:
            p.blocks, p.done, p.start, p.end, p.upto, p.last = (), 0, 0, 0, [], False
        if req in self._step_reqs:
            self._step_reqs.remove(req)
        self._finals_due -= {(r, reader) for r, reader in self._finals_due if r == req}

    def _rewrite_unsure_streams(self, req: str, o: Outcome) -> None:
        """Every token of these ranks is written again from the new blocks; nothing is
        posted before the writes that may carry another request's bytes are over, since
        NIXL does not order two writes into one block (``_check`` resumes it)."""
        assert isinstance(o.event, ev.StreamPreempted)
        for reader in o.event.unsure:
            w = self.streams.get(req, {}).get(reader)
            if w is not None:
                w.written, w.rewrite = [0] * len(w.written), True
                self.ctx.note("worker.stream_rewrite", req, reader=reader, in_flight=len(w.handles))

    def _fail_notified_streams(self, req: str, o: Outcome) -> None:
        assert isinstance(o.event, ev.StreamPreempted)
        for reader in o.event.notified:
            w = self.streams.get(req, {}).get(reader)
            if w is not None:
                self._fail(req, reader, w, "vLLM preempted the prefill and freed its blocks while the write "
                                           "carrying the landed notification was in flight: the bytes it "
                                           "carried are not sure")

    def _on_layer(self, item: tuple[str, int]) -> None:
        layer, at_ns = item
        idx = self.layers.get(layer)
        if idx is None:
            return
        for req in self._step_reqs:
            p = self.progress.get(req)
            if p is None:
                continue
            if idx < len(p.upto):
                p.upto[idx] = p.end
            if p.last and all(u >= p.end for u in p.upto):
                p.last_layer_ns = at_ns
            for reader, w in list(self.streams.get(req, {}).items()):
                self.ctx.guard(req, self._write_layer, (req, reader, w, idx, p.end))

    def _on_step_over(self, _: None) -> None:
        for req in self._step_reqs:
            p = self.progress.get(req)
            if p is None:
                continue
            p.done = p.end
            p.upto = [p.end] * len(self.layers)
            for reader, w in list(self.streams.get(req, {}).items()):
                self.ctx.guard(req, self._catch_up, (req, reader, w))
        self._step_reqs = []

    # -- the decode worker's ask ---------------------------------------------------------------

    def on_ask(self, ask: WriteAsk, spec: WriteSpec, agent: str, unreachable: str, wall: int, now: int) -> str:
        """Answer one streamed write ask: "ok" (taken), "unknown" (not known here yet,
        or in no state to stream), "expired" (it will never be written)."""
        req = self.keys.get(spec.req)
        if req is None or req not in self.ctx.send:
            return ANSWER_UNKNOWN
        left = spec.deadline_wall_ns - LEASE_MARGIN_NS - wall
        rows = dst_rows(spec, max(self._groups, default=0) + 1 if self.layers else 1)
        if left <= 0 or unreachable or not self.layers or isinstance(rows, str):
            why = unreachable or (f"its write ask came {-left / 1e9:.3f} s past its deadline" if left <= 0 else
                                  "this worker's KV pool has no layers to stream" if not self.layers else str(rows))
            self._apply_send(ev.RemoteAbandoned(req=req, reason=f"write ask of {ask.requester}: {why}"[:300],
                                                reader=ask.requester, readers=spec.readers))
            return "expired"
        if ask.requester in self.streams.get(req, {}):
            return ANSWER_OK
        assert not isinstance(rows, str)
        w = Stream(agent, spec, now + left, [0] * len(self.layers), rows)
        self.streams.setdefault(req, {})[ask.requester] = w
        o = self._apply_send(ev.StreamAsked(req=req, reader=ask.requester, readers=spec.readers,
                                            num_blocks=len(spec.dst_blocks), deadline_wall_ns=spec.deadline_wall_ns))
        if o is None or not o.ok or o.stale:
            self._drop(req, ask.requester)
            return ANSWER_UNKNOWN
        return ANSWER_OK

    def _pass_abandon(self, key: str, o: Outcome) -> None:
        """The decode side gave up by the key before it named a request here: that request hears it."""
        assert isinstance(o.event, ev.StreamJoined)
        self._apply_send(ev.RemoteAbandoned(
            req=o.event.joined, reason=f"abandoned by its join key {key} before its prefill started here"))

    def _start_stream(self, req: str, o: Outcome) -> None:
        """Write what is computed already (the ask came after some of it)."""
        assert isinstance(o.event, ev.StreamAsked)
        reader = o.event.reader
        w = self.streams.get(req, {}).get(reader)
        if w is not None:
            self._catch_up((req, reader, w))

    # -- writing ----------------------------------------------------------------------------------

    def _catch_up(self, item: tuple[str, str, Stream]) -> None:
        req, reader, w = item
        p = self.progress.get(req)
        if p is None:
            self._fail(req, reader, w, "nothing is known here of the request's blocks")
            return
        for idx in range(len(w.written)):
            if self.streams.get(req, {}).get(reader) is not w:
                return  # failed meanwhile
            self._write_layer((req, reader, w, idx, p.upto[idx] if idx < len(p.upto) else p.done))
        self._maybe_final(req, reader, w)

    def _write_layer(self, item: tuple[str, str, Stream, int, int]) -> None:
        """Write layer ``idx`` of the blocks holding tokens not written yet, up to ``upto``."""
        req, reader, w, idx, upto = item
        if w.rewrite:
            return  # (written again once the writes in question are over: ``_check``)
        p = self.progress.get(req)
        size = self.ctx.cfg.block_size
        if p is not None and not (p.last and upto >= p.end):
            # Whole blocks only, but for the prompt's last: a block written while partly
            # computed would be written again, and NIXL does not order the two writes
            # (the first, stale past its tokens, may land last).
            upto = upto // size * size
        have = w.written[idx]
        if p is None or upto <= have or self.streams.get(req, {}).get(reader) is not w:
            return
        spec = w.spec
        src, (first, dst) = self._pair_rows(p, w, idx)
        lo = max(have // size, first)
        hi = min((upto - 1) // size, first + len(dst) - 1, len(src) - 1)
        w.written[idx] = upto
        pairs = [(src[j], dst[j - first]) for j in range(lo, hi + 1) if src[j] != UNWRITTEN]
        if not pairs:
            self._maybe_final(req, reader, w)
            return
        if self.loop.now_ns() >= w.deadline_ns:
            self._fail(req, reader, w, "its deadline passed before the prefill computed it", at_deadline=True)
            return
        # The last write of all carries the notification, once every other one is over.
        final = complete(p, w) and self._settled(req, reader, w)
        if self.streams.get(req, {}).get(reader) is not w:
            return
        transport = self.ctx.transport
        assert transport is not None
        layer = self._layer_name(idx)
        posting_ns = self.loop.now_ns()
        try:
            h = transport.post_layer_write(w.agent, layer, [a for a, _ in pairs], [b for _, b in pairs],
                                           spec.notif if final else b"", tag=spec.dst_req)
        except (ValueError, ConnectionError, NotImplementedError) as e:
            self._fail(req, reader, w, f"{type(e).__name__}: {e}")
            return
        if transport.check(h) is TransferState.ERROR:
            self._fail(req, reader, w, getattr(h, "error", "") or "the write ended in error")
            return
        w.writes += 1
        last = complete(p, w)
        if last:  # (the last write of all: the handover's last write, timed)
            w.final_posting_ns, w.final_posted_ns = posting_ns, self.loop.now_ns()
        if final:
            w.final = h
        else:
            w.handles.append(h)
            if last:
                self._final_due(req, reader)

    def _pair_rows(self, p: Progress, w: Stream, idx: int) -> tuple[tuple[int, ...], tuple[int, tuple[int, ...]]]:
        return pair_rows(p, w, self._groups[idx] if idx < len(self._groups) else 0)  # (known: the layers were read)

    def _layer_name(self, idx: int) -> str:
        for name, i in self.layers.items():
            if i == idx:
                return name
        raise ValueError(f"no layer {idx}")

    def _settled(self, req: str, reader: str, w: Stream) -> bool:
        """Every write posted so far is over (one that failed fails the stream: False)."""
        transport = self.ctx.transport
        assert transport is not None
        for h in list(w.handles):
            state = transport.check(h)
            if state is TransferState.DONE:
                transport.release(h)
                w.handles.remove(h)
                w.seen_over_ns = self.loop.now_ns()
            elif state is TransferState.ERROR:
                self._fail(req, reader, w, getattr(h, "error", "") or "a layer's write ended in error")
                return False
        return not w.handles

    def _final_due(self, req: str, reader: str) -> None:
        """The last write went out while others were in flight: its notification waits
        until they are over, seen within a tick (not at the loop's next millisecond)."""
        self._finals_due.add((req, reader))
        if self._ticker is None and self.loop.thread is not None:  # (not on a driven loop)
            self._ticker = PollTicker(self.loop, self._check_finals_due, STREAM_POLL_S)

    def _check_finals_due(self) -> None:
        for req, reader in list(self._finals_due):
            w = self.streams.get(req, {}).get(reader)
            if w is None or w.final is not None:
                self._finals_due.discard((req, reader))
            else:
                self.ctx.guard(req, self._check, (req, reader, w))
        if not self._finals_due and self._ticker is not None:
            self._ticker.stop()
            self._ticker = None

    def _maybe_final(self, req: str, reader: str, w: Stream) -> None:
        """Every layer written and over, but no write carried the notification (the
        last went out while others were in flight, or nothing of ours was wanted in
        the last layer): it goes alone. NIXL itself sends a write's notification at
        the check that finds the write's bytes flushed to the peer; every write is
        so here, hence the same order, with no bytes written twice."""
        p = self.progress.get(req)
        if (w.final is not None or p is None or not complete(p, w)
                or not self._settled(req, reader, w)):
            return
        self._finals_due.discard((req, reader))
        transport = self.ctx.transport
        assert transport is not None
        if not w.final_posting_ns:
            w.final_posting_ns = w.final_posted_ns = self.loop.now_ns()
        try:
            sent = transport.send_notif(w.agent, w.spec.notif)
        except ConnectionError as e:
            self._fail(req, reader, w, f"ConnectionError: {e}")
            return
        if not sent:
            self._fail(req, reader, w, "every write is over, but the notification saying so could not be sent")
            return
        self._written(req, reader, w, p, alone=True)

    def _written(self, req: str, reader: str, w: Stream, p: Progress | None, alone: bool = False) -> None:
        """The decode rank is told: every byte is there."""
        self._drop(req, reader)
        # The handover's tail starts when the prompt's last layer was done here.
        self.ctx.note("worker.stream_written", req, key=p.key if p else "", reader=reader, writes=w.writes,
                      steps=p.steps if p else 0, last_layer_ns=p.last_layer_ns if p else 0,
                      final_posting_ns=w.final_posting_ns, final_posted_ns=w.final_posted_ns,
                      done_ns=self.loop.now_ns(), notif_alone=alone)
        self._apply_send(ev.WriteDone(req=req, reader=reader, readers=w.spec.readers))

    # -- the poll ------------------------------------------------------------------------------

    def poll(self) -> None:
        for req, by_reader in list(self.streams.items()):
            for reader, w in list(by_reader.items()):
                self.ctx.guard(req, self._check, (req, reader, w))

    def _check(self, item: tuple[str, str, Stream]) -> None:
        req, reader, w = item
        transport = self.ctx.transport
        assert transport is not None
        # Every check releases the writes over (and notes when: a preemption asks).
        settled = self._settled(req, reader, w)
        if self.streams.get(req, {}).get(reader) is not w:
            return  # a write had failed
        if w.rewrite and settled:  # the writes in question are over: write it again
            w.rewrite = False
            self._catch_up((req, reader, w))
            if self.streams.get(req, {}).get(reader) is not w:
                return
        if w.final is not None and settled:
            state = transport.check(w.final)
            if state is TransferState.DONE:
                transport.release(w.final)
                self._written(req, reader, w, self.progress.get(req))
                return
            if state is TransferState.ERROR:
                self._fail(req, reader, w, getattr(w.final, "error", "") or "the last write ended in error")
                return
        if self.streams.get(req, {}).get(reader) is not w:
            return
        if self.loop.now_ns() >= w.deadline_ns:
            self._fail(req, reader, w, "cancelled in flight at its deadline", at_deadline=True)
        else:
            self._maybe_final(req, reader, w)

    # -- endings --------------------------------------------------------------------------------

    def _stop(self, w: Stream, at_deadline: bool = False, given_up: bool = False) -> bool:
        """Stop every write of ``w`` and tell its decode rank how it ended, now or
        once none is in flight (``Drains``); True when some were in flight."""
        in_flight = self.drains.stop(w.agent, w.spec.notif, [*w.handles, *([w.final] if w.final else [])],
                                     w.final, w.deadline_ns, at_deadline=at_deadline, given_up=given_up)
        w.handles.clear()
        w.final = None
        return in_flight

    def _fail(self, req: str, reader: str, w: Stream, detail: str, at_deadline: bool = False) -> None:
        if self.streams.get(req, {}).get(reader) is not w:
            return
        in_flight = self._stop(w, at_deadline)
        self._drop(req, reader)
        if in_flight or at_deadline:
            self.ctx.note("worker.write_cancelled", req, reader=reader, why=detail[:200])
        self._apply_send(ev.WriteDone(req=req, reader=reader, readers=w.spec.readers, ok=False, detail=detail[:300]))

    def cancel(self, req: str, given_up: bool = False) -> None:
        """The blocks are freed (or the request ends): nothing more of it is written
        (``given_up``: by its decode ranks)."""
        for reader, w in list(self.streams.get(req, {}).items()):
            self._stop(w, given_up=given_up)
            self._drop(req, reader)

    def _drop(self, req: str, reader: str) -> None:
        by_reader = self.streams.get(req)
        if by_reader is not None:
            by_reader.pop(reader, None)
            if not by_reader:
                del self.streams[req]

    def ended(self, req: str) -> None:
        self.cancel(req)
        p = self.progress.pop(req, None)
        if p is not None and self.keys.get(p.key) == req:
            del self.keys[p.key]
        if req in self._step_reqs:
            self._step_reqs.remove(req)
