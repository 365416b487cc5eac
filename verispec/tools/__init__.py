"""Tool calling (OpenAI's function tools): the tools and tool_choice of a request (spec.py), the
grammar a call follows (grammar.py), tools in the chat prompt (prompt.py), and the calls read
back out of the text (parser.py)."""

from .grammar import tool_grammar
from .parser import StreamedCalls, ToolCall, split_calls
from .prompt import DEFAULT_PREAMBLE, render_tool_chat
from .spec import Tool, ToolUse, tool_use

__all__ = ["DEFAULT_PREAMBLE", "StreamedCalls", "Tool", "ToolCall", "ToolUse", "render_tool_chat", "split_calls",
           "tool_grammar", "tool_use"]
