"""Running the app under uvicorn, with a shutdown that does not wait on decoding.

On SIGTERM or Ctrl-C uvicorn stops accepting connections and waits for the open ones
before it tells the app (lifespan shutdown), so a stream would go on decoding through
the grace period and then be cut.  Here the signal reaches the decoding worker at once:
it takes no more work, the running job stops after its round (its stream ends with an
error event and [DONE]), queued clients are answered 503; the connections then close
by themselves, well inside the grace period."""
from __future__ import annotations

import asyncio
import signal

import uvicorn

GRACE_S = 1.5      # the most uvicorn waits for connections after a signal (they close sooner)


class Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_exit):
        super().__init__(config)
        self.on_exit = on_exit
        self.loop = None
        self.interrupted = False   # a Ctrl-C (SIGINT) stopped it

    async def serve(self, sockets=None):
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame):
        # a signal handler: it may interrupt the loop's thread anywhere, so the worker
        # (whose queue takes locks) is told from the loop, not from here
        self.interrupted = self.interrupted or sig == signal.SIGINT
        if not self.should_exit and self.loop is not None:
            self.loop.call_soon_threadsafe(self.on_exit)
        super().handle_exit(sig, frame)


def run(app, host: str, port: int, log_level: str) -> int:
    """Serve until a signal; the exit status (130 after Ctrl-C)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=GRACE_S)
    server = Server(config, on_exit=app.state.worker.begin_shutdown)
    try:
        server.run()
    except KeyboardInterrupt:   # uvicorn raises the Ctrl-C again once it has shut down cleanly
        return 130
    # ... but asyncio's runner may take that second SIGINT as a cancellation of a serve()
    # that is already returning, and then nothing is raised: the status says it anyway
    return 130 if server.interrupted else 0
