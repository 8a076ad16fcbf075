"""Runs the frontend with uvicorn: in the foreground (``splitserve openai``), or on a thread of
its own beside ``splitserve serve``."""

from __future__ import annotations

import argparse
import threading
import time

import uvicorn
from fastapi import FastAPI

from splitserve.openai.app import create_app
from splitserve.openai.health import Readiness
from splitserve.openai.options import OpenAIOptions, add_arguments, options_from_args

START_TIMEOUT_S = 30.0


def _server(app: FastAPI, options: OpenAIOptions) -> uvicorn.Server:
    config = uvicorn.Config(
        app,
        host=options.host,
        port=options.port,
        log_level=options.log_level,
        timeout_graceful_shutdown=5,
    )
    return uvicorn.Server(config)


def run(options: OpenAIOptions) -> None:
    """Serve until SIGINT/SIGTERM."""
    print(
        f"splitserve openai: {options.model_name!r} -> Triton {options.triton_model!r} at "
        f"{options.triton_url}; http://{options.host}:{options.port}/v1",
        flush=True,
    )
    _server(create_app(options), options).run()


class BackgroundFrontend:
    """The frontend on a daemon thread; ``stop`` ends it."""

    def __init__(self, options: OpenAIOptions) -> None:
        self.options = options
        app = create_app(options)
        self._readiness: Readiness = app.state.readiness
        self._server = _server(app, options)
        self._thread = threading.Thread(target=self._server.run, name="openai-api", daemon=True)

    def start(self) -> BackgroundFrontend:
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not self._server.started:
            raise RuntimeError(f"the OpenAI frontend did not start on port {self.options.port}")
        return self

    def shutting_down(self) -> None:
        """``/health`` answers 503 from now on: the server behind it is about to stop."""
        self._readiness.shutting_down()

    def stop(self) -> None:
        self.shutting_down()
        self._server.should_exit = True
        self._thread.join(START_TIMEOUT_S)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="splitserve openai", description="OpenAI-compatible API in front of Triton"
    )
    add_arguments(ap)
    run(options_from_args(ap.parse_args(argv)))


if __name__ == "__main__":
    main()
