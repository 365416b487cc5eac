"""`verispec serve --ray-replicas N`: the app of app.py as a Ray Serve deployment of N replicas,
each with its own engine, behind Ray Serve's HTTP proxy.

Requests (streamed or not) are spread over the replicas by the proxy; a request runs whole on
one replica, so what it returns does not depend on N. A client that disconnects has its request
cancelled by the proxy, which cancels the handler on the replica: as under uvicorn, that aborts
the request before the engine's next step. Every response names its replica in the header
x-verispec-replica; GET /metrics is answered by one replica, about itself (the header says which).

The body limit and the request timeout inside the app apply as under `verispec serve`; the
header timeout and connection cap are uvicorn's, and the proxy's own settings replace them.
"""

from __future__ import annotations

from typing import Any

from ray import serve

from ..config import ServeLimits
from .app import build_app
from .limits import ASGIApp, Message, Receive, Scope, Send

REPLICA_HEADER = "x-verispec-replica"


class ReplicaHeader:
    """ASGI middleware: adds the replica's id to every HTTP response's headers."""

    def __init__(self, app: ASGIApp, replica: str) -> None:
        self.app = app
        self.header = (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def tagged(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = message | {"headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, tagged if scope["type"] == "http" else send)


@serve.ingress()
class OpenAIReplica:
    """One replica: an LLM built from `llm_kwargs` (LLM's arguments) with `threads` torch threads;
    web_ui: whether it serves the chat page at GET / (app.py)."""

    def __init__(self, llm_kwargs: dict[str, Any], model_name: str, limits: ServeLimits, threads: int,
                 web_ui: bool = True) -> None:
        import torch

        from ..engine.llm import LLM

        torch.set_num_threads(threads)
        self.llm = LLM(**llm_kwargs, progress=False)
        self.model_name = model_name
        self.limits = limits
        self.web_ui = web_ui

    def __serve_build_asgi_app__(self) -> ASGIApp:
        app = build_app(self.llm, self.model_name, self.limits, self.web_ui)
        app.add_middleware(ReplicaHeader, replica=serve.get_replica_context().replica_tag)
        return app


def check_replicas(replicas: int, threads: int) -> None:
    """Raises ValueError naming the flag of a bad count (before Ray is started for nothing)."""
    for name, value in (("--ray-replicas", replicas), ("--threads", threads)):
        if value < 1:
            raise ValueError(f"{name}={value} is invalid: expected an integer >= 1")


def deploy(llm_kwargs: dict[str, Any], model_name: str, limits: ServeLimits, replicas: int, threads: int,
           host: str, port: int, web_ui: bool = True) -> str:
    """Starts Ray Serve's proxy on host:port (in the Ray session already open) with `replicas`
    replicas of the app; returns the base URL once every replica is ready."""
    check_replicas(replicas, threads)
    serve.start(http_options={"host": host, "port": port})
    deployment = serve.deployment(OpenAIReplica).options(
        name="verispec", num_replicas=replicas, ray_actor_options={"num_cpus": threads},
        max_ongoing_requests=1024,  # the engine's own queue and turns decide, not the proxy
    )
    serve.run(deployment.bind(llm_kwargs, model_name, limits, threads, web_ui), name="verispec", route_prefix="/")
    return f"http://{host}:{port}"
