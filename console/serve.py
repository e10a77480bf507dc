"""The web processes: uvicorn's workers, each listening on a socket of its own.

`python -m console.serve --host H --port P --workers N` (the Procfile's `web` line) runs the
ASGI application (console.asgi) in N uvicorn worker processes under uvicorn's own supervisor
(restarts, signals, health checks), with one difference: uvicorn's `--workers` share ONE
listening socket, and whichever worker's event loop wakes first for it accepts every
connection then waiting — a burst of new connections (eight operators' browsers, a client's
pool) lands on one process while the other idles (measured: all 296 decisions of the bench's
change phase served by one of two processes, its held polls woken behind them). Here each
worker binds its own socket with SO_REUSEPORT, and the kernel spreads new connections over
them by their addresses' hash.

SO_REUSEPORT lets another process of the same user bind the same port and take a share of its
connections: run the web processes under a user of their own, as any service should be.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys

import uvicorn
from uvicorn.config import STARTUP_FAILURE
from uvicorn.supervisors import multiprocess

APPLICATION = "console.asgi:application"
logger = logging.getLogger("uvicorn.error")


def listening_socket(host: str, port: int, backlog: int) -> socket.socket:
    """A TCP socket bound to (host, port) in the port's SO_REUSEPORT group, listening."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


class OwnSocketServer(uvicorn.Server):
    """A uvicorn server that listens on a socket it binds itself (listening_socket) instead
    of one its supervisor shares with the other workers."""

    def run(self, sockets: list[socket.socket] | None = None) -> None:
        config = self.config
        try:
            own = listening_socket(config.host, config.port, config.backlog)
        except OSError as exc:
            logger.error("cannot listen on %s:%s: %s", config.host, config.port, exc)
            # uvicorn's supervisor stops, instead of restarting a worker that cannot start.
            sys.exit(STARTUP_FAILURE)
        super().run(sockets=[own])


class OwnSocketProcess(multiprocess.Process):
    """uvicorn's worker process, serving through OwnSocketServer."""

    @property
    def server(self) -> uvicorn.Server:
        if self._server is None:
            self._server = OwnSocketServer(config=self.config)
        return self._server


def config_from(argv: list[str]) -> uvicorn.Config:
    parser = argparse.ArgumentParser(prog="python -m console.serve", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args(argv)
    # The uvicorn options the Procfile's line used to give: no Server header, no lifespan.
    return uvicorn.Config(
        APPLICATION,
        host=args.host,
        port=args.port,
        workers=max(1, args.workers),
        server_header=False,
        lifespan="off",
    )


def main(argv: list[str]) -> None:
    config = config_from(argv)
    # uvicorn says where it listens when it binds the shared socket itself; say it here.
    logger.info(
        "Uvicorn running on http://%s:%d, a listening socket per process (Press CTRL+C to quit)",
        config.host,
        config.port,
    )
    if config.workers == 1:
        OwnSocketServer(config).run()
        return
    # uvicorn's supervisor makes each worker with the module's `Process`; ours binds its own
    # socket. No socket is shared (the empty list).
    multiprocess.Process = OwnSocketProcess  # type: ignore[misc]
    supervisor = multiprocess.Multiprocess(config, sockets=[])
    supervisor.run()
    if any(process.exitcode == STARTUP_FAILURE for process in supervisor.processes):
        sys.exit(STARTUP_FAILURE)  # a worker could not start: say so, as uvicorn's CLI does


if __name__ == "__main__":
    main(sys.argv[1:])
