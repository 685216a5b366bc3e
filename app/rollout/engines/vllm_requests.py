"""Requests in flight in one vLLM `LLMEngine`, driven by hand: added, stepped until each is finished, and aborted if
the caller leaves early.

`LLM.generate` adds a whole batch and steps until it drains. The continuous schedule adds an episode's next turn as
soon as its reply is out, so it needs the engine's own add / step / abort calls. An error between them (a bad reply,
an environment that raised) must not leave requests running into the next batch, where their outputs would arrive
unasked for.
"""

from __future__ import annotations

from collections.abc import Iterator


class EngineRequests:
    """Requests added to one engine and not yet finished. Use it in a `with` block: leaving the block while any is
    still in flight (an error, an early return) aborts them."""

    def __init__(self, engine):
        self.engine = engine
        self.in_flight: set[str] = set()

    def add(self, request_id: str, rendered, params, lora_request) -> None:
        """One rendered request into the engine core, whose final output alone comes back."""
        from vllm.sampling_params import RequestOutputKind

        params.output_kind = RequestOutputKind.FINAL_ONLY
        self.engine.add_request(request_id, rendered, params, lora_request=lora_request)
        self.in_flight.add(request_id)

    def finished(self) -> Iterator:
        """Each request's final output as the engine finishes it, until none is in flight; requests added while this
        runs are waited for too."""
        while self.in_flight:
            for out in self.engine.step():
                if out.finished and out.request_id in self.in_flight:
                    self.in_flight.discard(out.request_id)
                    yield out

    def __enter__(self) -> EngineRequests:
        return self

    def __exit__(self, *exc) -> None:
        if self.in_flight:
            self.engine.abort_request(sorted(self.in_flight))
            self.in_flight.clear()
