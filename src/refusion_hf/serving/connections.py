"""`refusion serve`'s HTTP connections: uvicorn's h11 protocol (`uvicorn.protocols.http.h11_impl.H11Protocol`, passed as
uvicorn's `http` option) with a deadline on each request's head. uvicorn closes a keep-alive connection on which
no byte arrives for `timeout_keep_alive` seconds, but a client that connects and sends nothing, or sends its
request line and headers a byte at a time, holds its socket for ever; here a connection whose next request head has
not fully arrived `HEAD_SECONDS` after the connection opened (or its last answer ended) is closed. The body's
deadline is the app's (`app.RequestGate`: 408), and h11's limit on the head's size (`h11_max_incomplete_event_size`,
16 KiB by default) stays uvicorn's.
"""

from __future__ import annotations

from uvicorn.protocols.http.h11_impl import H11Protocol

HEAD_SECONDS = 10.0


class HeadDeadlineProtocol(H11Protocol):
    head_seconds = HEAD_SECONDS

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.head_deadline = None
        self.arm_head_deadline()

    def arm_head_deadline(self) -> None:
        if self.head_deadline is not None:
            self.head_deadline.cancel()
        self.waiting_after = self.cycle  # the request head awaited is the one after this cycle's
        self.head_deadline = self.loop.call_later(self.head_seconds, self.head_too_slow)

    def head_too_slow(self) -> None:
        self.head_deadline = None
        if self.cycle is self.waiting_after and not self.transport.is_closing():
            self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        if self.head_deadline is not None and self.cycle is not self.waiting_after:  # a request head arrived
            self.head_deadline.cancel()
            self.head_deadline = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self.arm_head_deadline()

    def connection_lost(self, exc) -> None:
        if self.head_deadline is not None:
            self.head_deadline.cancel()
            self.head_deadline = None
        super().connection_lost(exc)
