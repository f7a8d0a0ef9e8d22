"""Running the server: uvicorn on the Starlette app, and the drain on SIGTERM.

On the first SIGTERM (or SIGINT) the server stops accepting connections; requests in flight get
``drain_timeout_s`` to finish, and those still running then end with an error (an error event when streaming). A
half-sent upload is answered 503 at once, a connection still sending its headers is closed, and uvicorn cancels what
still runs 1 s after the drain, so the process exits within ``drain_timeout_s`` + 1 s (and the scheduler's current
step). A second signal exits at once (uvicorn's own behaviour).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging

from medusa.serve.app import ServeConfig, Server, build_app
from medusa.serve.scheduler import SPECULATION

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
PORT = 8000
DRAIN_TIMEOUT_S = 30.0


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """``medusa serve``'s own flags (the decoding ones are :func:`medusa.build.add_decode_arguments`'), their
    defaults read from :class:`medusa.serve.app.ServeConfig` and :func:`serve`."""
    default = {f.name: f.default for f in dataclasses.fields(ServeConfig)}
    p.add_argument("--host", default=LOOPBACK, help="address to bind (loopback by default: only this machine)")
    p.add_argument("--port", type=int, default=PORT, help="TCP port")
    p.add_argument("--served-model-name", help="the model name clients ask for (default: the heads folder's name)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 requests (shows in ps: prefer "
                                     "--api-key-file or the MEDUSA_API_KEY environment variable)")
    p.add_argument("--api-key-file", help="read the API key from the first line of this file")
    p.add_argument("--allowed-host", action="append", default=[], dest="allowed_hosts", metavar="NAME",
                   help="a Host name the server answers for, beside localhost, 127.0.0.1, ::1 and --host "
                        "(repeatable; '*' for any); other Host headers get 421")
    p.add_argument("--cors-origin", action="append", default=[], dest="cors_origins", metavar="ORIGIN",
                   help="an origin browsers may call the API from, e.g. https://app.example (repeatable; none by "
                        "default)")
    p.add_argument("--max-running", type=int, default=default["max_running"],
                   help="requests decoding at once (rows of the batch)")
    p.add_argument("--max-waiting", type=int, default=default["max_waiting"],
                   help="requests queued beyond those running; more get 429")
    p.add_argument("--prefill-chunk", type=int, default=default["prefill_chunk"],
                   help="prompt tokens prefilled per scheduler round: a longer prompt joins over several rounds, "
                        "the running requests stepping between them")
    p.add_argument("--prefix-cache-mb", type=float, default=default["prefix_cache_mb"],
                   help="megabytes of prefilled prompts kept, so that a prompt starting like a kept one (the chat "
                        "template's system turn, a conversation's earlier turns) is prefilled from after the shared "
                        "tokens; exact, through the native engines only; 0: off")
    p.add_argument("--max-body-bytes", type=int, default=default["max_body_bytes"],
                   help="largest request body, counted as it arrives (413 beyond)")
    p.add_argument("--max-header-bytes", type=int, default=default["max_header_bytes"],
                   help="largest request line and headers (400 beyond)")
    p.add_argument("--read-timeout-s", type=float, default=default["read_timeout_s"],
                   help="a client that sends nothing of its headers or body for this long is cut off")
    p.add_argument("--max-connections", type=int, default=default["max_connections"],
                   help="open connections at once; more are closed as soon as they are made")
    p.add_argument("--keep-alive-s", type=float, default=default["keep_alive_s"],
                   help="an idle keep-alive connection is closed after this long")
    p.add_argument("--idle-release-s", type=float, default=default["idle_release_s"],
                   help="after this long with no request, free memory goes back to the system (0: never)")
    p.add_argument("--request-timeout-s", type=float, default=default["request_timeout_s"],
                   help="a request still running then is ended")
    p.add_argument("--default-max-tokens", type=int, default=default["default_max_tokens"],
                   help="new tokens when a request sets no max_tokens (less when the context has less room)")
    p.add_argument("--drain-timeout-s", type=float, default=DRAIN_TIMEOUT_S,
                   help="on SIGTERM, requests in flight get this long to finish, then end with an error")
    p.add_argument("--speculation", choices=SPECULATION, default=default["speculation"],
                   help="auto: each batched step speculative or plain, whichever measured faster at that batch "
                        "size; on: always speculative; off: plain decoding only")
    p.add_argument("--acceptance", default=default["acceptance"],
                   help="sampling requests: 'rejection' (lossless), 'coupled' (lossless; a seeded request's "
                        "tokens the same whatever the load, up to float rounding) or 'typical' (Medusa's typical "
                        "acceptance, lossy)")


def make_uvicorn_server(server: Server, host: str = LOOPBACK, port: int = PORT,
                        drain_timeout_s: float = DRAIN_TIMEOUT_S, log_level: str = "warning"):
    """A ``uvicorn.Server`` for ``server`` whose exit signal starts the drain (see module docstring).

    Raises:
        ValueError: a negative ``drain_timeout_s``.
    """
    import uvicorn

    if drain_timeout_s < 0:
        raise ValueError(f"drain_timeout_s must be >= 0, got {drain_timeout_s}")

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            server.drain(drain_timeout_s)
            super().handle_exit(sig, frame)

    config = uvicorn.Config(build_app(server, host), host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=drain_timeout_s + 1, access_log=False,
                            http=http_protocol(server.config), timeout_keep_alive=server.config.keep_alive_s,
                            h11_max_incomplete_event_size=server.config.max_header_bytes)
    return DrainingServer(config)


def http_protocol(config: ServeConfig):
    """uvicorn's h11 protocol with the server's connection hygiene: at most ``max_connections`` open (one more is
    closed as soon as it is made); a connection that sends no complete request line and headers within
    ``read_timeout_s`` of its first byte (or of connecting) is closed; a request it cannot parse (malformed, or
    headers over ``max_header_bytes``) is answered with OpenAI's error body rather than plain text."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    limit = config.max_header_bytes

    class Protocol(H11Protocol):
        header_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > config.max_connections:
                logger.info("refused a connection from %s: %d open, the limit", self.client and self.client[0],
                            config.max_connections)
                self.transport.close()
                return
            self._await_headers()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is None or self.cycle.response_complete:  # between requests: headers awaited
                self._await_headers()
            elif self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None

        def connection_lost(self, exc) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
            super().connection_lost(exc)

        def _await_headers(self) -> None:
            if self.header_timer is None and not self.transport.is_closing():
                self.header_timer = self.loop.call_later(config.read_timeout_s, self._headers_late)

        def _headers_late(self) -> None:
            self.header_timer = None
            if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
                logger.info("closed a connection from %s: no complete request headers within %g s",
                            self.client and self.client[0], config.read_timeout_s)
                self.transport.close()

        def send_400_response(self, msg: str) -> None:
            body = json.dumps({"error": {"message": f"the request is not valid HTTP/1.1, or its request line and "
                                                    f"headers are over the server's limit of {limit} bytes",
                                         "type": "invalid_request_error", "param": None,
                                         "code": "invalid_http_request"}}).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            for event in (h11.Response(status_code=400, headers=headers), h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

    return Protocol


def serve(model, config: ServeConfig, host: str = LOOPBACK, port: int = PORT, drain_timeout_s: float = DRAIN_TIMEOUT_S,
          log_level: str = "warning") -> None:
    """Serve ``model`` (a :class:`medusa.model.MedusaModel`) until SIGTERM/SIGINT, then drain and return."""
    if host not in (LOOPBACK, "localhost", "::1"):
        logger.warning("serving on %s: reachable from other machines%s", host,
                       "" if config.api_key else ", with no --api-key")
        if host in ("0.0.0.0", "::") and not config.allowed_hosts:
            logger.warning("bound to every address: only requests whose Host is localhost or 127.0.0.1 are "
                           "answered; pass --allowed-host NAME for the names clients use")
    make_uvicorn_server(Server(model, config), host, port, drain_timeout_s, log_level).run()
