"""`verispec serve`: an OpenAI-compatible HTTP server over one engine."""

from .app import build_app

__all__ = ["build_app"]
