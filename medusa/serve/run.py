"""Running the server: uvicorn on the Starlette app, and the drain on SIGTERM.

On the first SIGTERM (or SIGINT) the server stops accepting connections; requests in flight get
``drain_timeout_s`` to finish, and those still running then end with an error (an error event when streaming), so
the process exits within about that time. A second signal exits at once (uvicorn's own behaviour).
"""

from __future__ import annotations

import logging

from medusa.serve.app import ServeConfig, Server, build_app

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


def make_uvicorn_server(server: Server, host: str = LOOPBACK, port: int = 8000, drain_timeout_s: float = 30.0,
                        log_level: str = "warning"):
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

    config = uvicorn.Config(build_app(server), host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=drain_timeout_s + 5, access_log=False)
    return DrainingServer(config)


def serve(model, config: ServeConfig, host: str = LOOPBACK, port: int = 8000, drain_timeout_s: float = 30.0,
          log_level: str = "warning") -> None:
    """Serve ``model`` (a :class:`medusa.model.MedusaModel`) until SIGTERM/SIGINT, then drain and return."""
    if host not in (LOOPBACK, "localhost", "::1"):
        logger.warning("serving on %s: reachable from other machines%s", host,
                       "" if config.api_key else ", with no --api-key")
    make_uvicorn_server(Server(model, config), host, port, drain_timeout_s, log_level).run()
