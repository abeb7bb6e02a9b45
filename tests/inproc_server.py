"""The server app under uvicorn on a thread of the test process, for tests that build
the app with settings the command line does not have (a token limit for the fuzz
test, a chat template) and read its log records."""
import http.client
import json
import logging
import threading
import time

from bench.server_load import free_port


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)

    def errors(self) -> list:
        """Records at WARNING or above, and any with a traceback."""
        return [r for r in self.records if r.levelno >= logging.WARNING or r.exc_info]


class InProcessServer:
    LOGGERS = ("spel_mlx.server", "uvicorn", "uvicorn.error", "uvicorn.access")

    def __init__(self, loaded, tokenizer, **app_options):
        import uvicorn

        from spel_mlx.server.app import create_app
        self.app = create_app(loaded, tokenizer, model_id="spel-mlx-test", warmup=False, **app_options)
        self.port = free_port()
        self.log = Records()
        for name in self.LOGGERS:
            logging.getLogger(name).addHandler(self.log)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="info",
                                timeout_graceful_shutdown=2, log_config=None)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-test", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the in-process server did not start"
            time.sleep(0.02)

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
                conn: http.client.HTTPConnection | None = None):
        """(status, headers, body bytes); `conn` reuses a connection."""
        own = conn is None
        conn = conn or self.connect()
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        out = resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        if own:
            conn.close()
        return out

    def post_json(self, path: str, body: dict, headers: dict | None = None):
        status, hdrs, raw = self.request("POST", path, json.dumps(body).encode(),
                                         {"Content-Type": "application/json", **(headers or {})})
        return status, hdrs, raw

    def connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(60)
        for name in self.LOGGERS:
            logging.getLogger(name).removeHandler(self.log)
