"""The `verispec` command line.

    verispec generate "Write a haiku about the sea"          # chat template, n-gram drafts
    verispec generate --temperature 0 -k 8 "Repeat: ..."       # greedy, up to 8 drafts per step
    verispec generate --draft ngram+eagle --tree 3 "Explain rainbows."  # lookup + learned head
    verispec generate --draft none --no-chat "Once upon a time"
    verispec serve --port 8000                                  # OpenAI-compatible HTTP server
    verispec serve --ray-replicas 4 --address auto              # the same server, 4 engines on Ray Serve
    verispec run-batch -i requests.jsonl -o results.jsonl       # an OpenAI batch file, resumable
    verispec run-batch -i requests.jsonl -o results.jsonl --ray --replicas 4  # on Ray Data
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from typing import TYPE_CHECKING, NoReturn

from .config import ServeLimits, TreeShape, parse_tree
from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from .engine.engine import RequestOutput
    from .engine.llm import LLM
    from .model import Tokenizer

EPILOG = """\
Speculative decoding here is exact: with any --draft (n-gram, the EAGLE or Medusa heads, a head
file, a draft model) and any --tree, the output follows the same distribution as without it
(greedy output is identical token for token); drafts only change the speed. The summary line
reports tokens/s, the fraction of draft tokens accepted, and the mean number of tokens emitted
per verification step.

Classifier-free guidance: --guidance-scale 1.5 steers away from --negative-prompt (default: the
prompt's last token), and stays exact under speculation.
"""


class _Parser(argparse.ArgumentParser):
    """argparse, with every argument error as the one `verispec: error: ...` line (exit 2) that
    every other error of the command line is, not a usage block headed by the subcommand."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"verispec: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="verispec", description="Exact speculative decoding for LLM inference.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser(
        "generate", help="complete one prompt, streaming the text",
        description="Complete one prompt, streaming the text, then print one summary line.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    gen.add_argument("prompt", help="the prompt (a user message when --chat is on)")
    add_model_arguments(gen, "most draft tokens verified per step (default: 5)")
    gen.add_argument("--temperature", type=float, default=1.0, help="0 for greedy (default: 1.0)")
    gen.add_argument("--top-k", type=int, default=None, help="keep the k likeliest tokens (default: off)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (default: 1, off)")
    gen.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability (default: 0)")
    gen.add_argument("--seed", type=int, default=None, help="make sampling reproducible")
    gen.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default: 256)")
    gen.add_argument("--stop", action="append", default=[], help="stop at this string (repeatable)")
    gen.add_argument("--presence-penalty", type=float, default=0.0,
                     help="in [-2, 2]: subtracted from tokens already generated (default: 0)")
    gen.add_argument("--frequency-penalty", type=float, default=0.0,
                     help="in [-2, 2]: times each generated token's count, subtracted (default: 0)")
    gen.add_argument("--repetition-penalty", type=float, default=1.0,
                     help="> 0: shrinks tokens of the prompt and the output; 1 is off (default: 1)")
    gen.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS", type=_bias_entry,
                     help="add BIAS in [-100, 100] to token ID's logit (repeatable)")
    gen.add_argument("--ban-token", action="append", default=[], type=int, metavar="ID",
                     help="never emit token ID (repeatable)")
    gen.add_argument("--logprobs", type=int, default=None, metavar="N",
                     help="after the text, print each token's log-probability and its N likeliest "
                          "alternatives (0..20)")
    gen.add_argument("--guidance-scale", type=float, default=1.0, help="CFG scale gamma; 1 is off (default: 1)")
    gen.add_argument("--negative-prompt", default=None, help="text of the unconditional CFG branch")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                     help="wrap the prompt in the model's chat template (default: on)")
    shape = gen.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", default=None, metavar="FILE",
                       help="the output matches the JSON Schema in FILE (structured output)")
    shape.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    shape.add_argument("--regex", default=None, help="the output matches this regular expression")
    shape.add_argument("--grammar", default=None, metavar="FILE",
                       help="the output matches the Lark or GBNF grammar in FILE")
    add_serve_parser(sub)
    add_batch_parser(sub)
    add_train_parser(sub)
    return parser


def add_model_arguments(parser: argparse.ArgumentParser, k_help: str) -> None:
    """What every command that loads a model takes: the model, its drafter, dtype, device, threads."""
    parser.add_argument("--model", default=None,
                        help="a .gguf file or Hugging Face checkpoint directory (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--draft", default="ngram",
                        help="'ngram' (prompt lookup, default), 'eagle' or 'medusa' (learned heads shipped for "
                             "the embedded model), a head file from `verispec train-drafter`, 'ngram+eagle', "
                             "'ngram+medusa' or 'ngram+HEAD_FILE' (prompt lookup where the context repeats "
                             "itself, the head elsewhere), 'int4' / 'int8' (the target itself quantized at "
                             "load, int4 in groups of 64; 'int4-g32', 'int4-g128' choose the group), 'none', "
                             "or a draft model path sharing the tokenizer")
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=5, metavar="K", help=k_help)
    parser.add_argument("--tree", type=_tree_shape, default=None, metavar="B1,B2,...|dynamic[:N,D,K]",
                        help="tree speculation, verified exactly; replaces -k (default: off, chains of K "
                             "drafts). B1,B2,...: a static tree with B1 children of the root, B2 of each "
                             "of those, ... (e.g. 3,2,1). dynamic[:N,D,K]: EAGLE-2's tree grown by draft "
                             "confidence, N nodes, D levels, the K best nodes expanded per level with K "
                             "children each (default dynamic:16,5,4); EAGLE and Medusa grow trees "
                             "(the likeliest children when greedy, children drawn from the draft "
                             "distribution when sampling), n-gram fills tries, ngram+eagle grafts the "
                             "lookup's tries and the head's tree into one, a draft model drafts a "
                             "chain; a request drafts its whole tree only while its acceptance pays "
                             "for the tree's rows at the current batch size")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="weights and KV cache. auto (default): a .gguf file (the embedded model "
                             "too) runs its 4- and 8-bit blocks as stored, with compiled integer "
                             "kernels on the CPU (the fastest choice there); anything else float32. "
                             "float32 / bfloat16: widen the weights to it (bfloat16 halves memory "
                             "and, at batch 1, the bytes read per token)")
    parser.add_argument("--quantize", default=None, choices=["int8", "int4"],
                        help="weight-only round-to-nearest at load, e.g. for a Hugging Face "
                             "checkpoint: int4 (embedding and LM head int8) or int8")
    parser.add_argument("--quantize-group-size", type=int, default=32, choices=[32, 64, 128],
                        help="weights per scale with --quantize (default: 32)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="on CUDA, run decode and verify steps kernel by kernel instead of replaying "
                             "them as CUDA graphs; output is the same either way (vLLM's name)")
    parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse the KV cache of prompt prefixes already computed (shared system "
                             "prompts, negative prompts); output is the same either way (default: on)")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0, metavar="GIB",
                        help="memory for each model's paged KV cache, in GiB (default: 1)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


SERVE_EPILOG = """\
Any OpenAI client works; point it at http://HOST:PORT/v1, e.g.

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.chat.completions.create(model="verispec", messages=[{"role": "user", "content": "Hi"}],
                                   extra_body={"top_k": 50, "num_speculative_tokens": 3})

Endpoints: POST /v1/completions, POST /v1/chat/completions (stream: true for server-sent
events), GET /v1/models, GET /health, GET /metrics (Prometheus), and a chat page at GET / that
marks each token as an accepted draft or the verifier's own (--no-web-ui turns it off). Beyond OpenAI's fields, requests
accept top_k, min_p, repetition_penalty, guidance_scale, negative_prompt, ignore_eos and
num_speculative_tokens (per-request K, 0 turns speculation off for that request). Concurrent
requests share every engine step; speculation stays exact, so a request's output does not
depend on its K or on what else is being served. Bad input is a 400 with OpenAI's error object
naming the field (types are strict: "2" is not a number); an unknown model is a 404.

Limits (the options above): body size (413), sequences per request (n x prompts), header and body timeouts,
open connections; waiting requests are admitted in turns, so one request's fan-out cannot hold
the others back. GET /health is 503 while the engine is stuck in a step. With --host 0.0.0.0,
set the limits for your clients and put an authenticating proxy in front.

With --ray-replicas N the same app runs as N Ray Serve replicas behind Ray Serve's proxy; each
response names its replica (header x-verispec-replica), and /metrics and /health describe the
one replica that answered them.
"""


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser(
        "serve", help="serve the model over an OpenAI-compatible HTTP API",
        description="Serve one model over an OpenAI-compatible HTTP API (completions and chat, streamed or not).",
        epilog=SERVE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arguments(serve, "most draft tokens verified per step; a request's num_speculative_tokens "
                               "overrides it (default: 5)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0 for all: "
                            "then the limits below are what stands between a client and the others)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    serve.add_argument("--served-model-name", default="verispec",
                       help="the name clients pass as `model` (default: verispec)")
    serve.add_argument("--max-num-seqs", type=int, default=64,
                       help="most requests generated at once; more wait in the queue (default: 64)")
    limits = ServeLimits()
    serve.add_argument("--max-request-bytes", type=int, default=limits.max_request_bytes, metavar="BYTES",
                       help=f"largest request body; larger ones get 413 before being parsed "
                            f"(default: {limits.max_request_bytes})")
    serve.add_argument("--max-choices", type=int, default=limits.max_choices, metavar="N",
                       help=f"most sequences one request may ask for, n x prompts (default: {limits.max_choices}, "
                            "OpenAI's cap on n)")
    serve.add_argument("--header-timeout", type=float, default=limits.header_timeout_s, metavar="S",
                       help=f"seconds a client has to send a request's headers before the connection is "
                            f"closed (default: {limits.header_timeout_s:g})")
    serve.add_argument("--body-timeout", type=float, default=limits.body_timeout_s, metavar="S",
                       help=f"seconds a client has to send a request's body, else 408 "
                            f"(default: {limits.body_timeout_s:g})")
    serve.add_argument("--max-connections", type=int, default=limits.max_connections, metavar="N",
                       help=f"open connections before new requests get 503 (default: {limits.max_connections})")
    serve.add_argument("--stall-timeout", type=float, default=limits.stall_s, metavar="S",
                       help=f"GET /health answers 503 once the engine has spent this long in one step with "
                            f"work queued (default: {limits.stall_s:g})")
    serve.add_argument("--no-web-ui", dest="web_ui", action="store_false",
                       help="do not serve the chat page at GET / (default: served, on the API's own "
                            "host and port: a browser at http://HOST:PORT/ chats with the model and sees "
                            "which tokens were drafted and accepted)")
    serve.add_argument("--ray-replicas", type=int, default=None, metavar="N",
                       help="serve as a Ray Serve deployment of N replicas, each its own engine with "
                            "--threads threads (default 1), behind Ray Serve's proxy on --host:--port; "
                            "every response names its replica in the x-verispec-replica header, and "
                            "GET /metrics is answered by one replica about itself. --header-timeout and "
                            "--max-connections are then the proxy's business (default: off, one process)")
    serve.add_argument("--address", default=None,
                       help="with --ray-replicas: the Ray cluster to join, e.g. 'auto' or HOST:6379 from "
                            "`ray start --head` (default: start a local Ray, stopped on exit)")


BATCH_EPILOG = """\
Input: one request a line, OpenAI's batch format:
  {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions",
   "body": {"model": "verispec", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 64}}
Output: one record a line, appended (and flushed) as requests finish, in finishing order:
  {"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}
A body is validated and answered by the code of `verispec serve` (the same 400s, the same
response bodies); error is null for a 200, else {"code", "message"}. A line that is not a request
(bad JSON, no custom_id, another url) gets an error record and the rest go on; a custom_id on
two lines stops the command before anything runs. Rerunning the same command skips what the
output holds, so a killed run resumes. Seeded and greedy requests give the same records run
locally or on any number of replicas.
"""


def add_batch_parser(sub: argparse._SubParsersAction) -> None:
    batch = sub.add_parser(
        "run-batch", help="answer an OpenAI batch file (JSONL), locally or over Ray Data",
        description="Answer every request of an OpenAI batch file, with one engine batching them "
                    "continuously, or on Ray Data over N engines (--ray).",
        epilog=BATCH_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    batch.add_argument("-i", "--input", required=True, help="the requests, JSONL")
    batch.add_argument("-o", "--output", required=True, help="the results, JSONL (appended to: resumes)")
    add_model_arguments(batch, "most draft tokens verified per step; a body's num_speculative_tokens "
                               "overrides it (default: 5)")
    batch.add_argument("--served-model-name", default="verispec",
                       help="the `model` the bodies name (default: verispec)")
    batch.add_argument("--max-num-seqs", type=int, default=64,
                       help="most requests generated at once per engine (default: 64)")
    batch.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                       help="a progress bar on stderr: done / total, tokens/s, acceptance (default: on)")
    batch.add_argument("--ray", action="store_true",
                       help="run on Ray Data: an actor pool of --replicas engines (default: this process)")
    batch.add_argument("--address", default=None,
                       help="with --ray: the Ray cluster to join, e.g. 'auto' or HOST:6379 from "
                            "`ray start --head` (default: start a local Ray, stopped at the end)")
    batch.add_argument("--replicas", type=int, default=None, help="with --ray: engines (Ray actors) (default: 1)")
    batch.add_argument("--threads-per-replica", type=int, default=None, metavar="T",
                       help="with --ray: torch threads (and Ray CPUs) per replica (default: 1)")
    batch.add_argument("--batch-size", type=int, default=None,
                       help="with --ray: requests per Ray Data batch, the unit of retry (default: 64)")


def add_train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train-drafter",
        help="train an EAGLE or Medusa draft head for a model by self-distillation",
        description="Train a learned draft head: the model answers a prompt set (its hidden states "
                    "recorded during that generation), the head learns to predict its next-token "
                    "distributions, and the head's acceptance on held-out prompts is reported before "
                    "and after training. Interrupted runs resume from the cache directory.",
        epilog="example: verispec train-drafter --kind eagle --out eagle.safetensors; then "
               "verispec generate --draft eagle.safetensors 'Explain rainbows.'",
    )
    p.add_argument("--kind", choices=("eagle", "medusa"), required=True, help="head architecture")
    p.add_argument("--model", default=None,
                   help="target model: .gguf file or Hugging Face directory (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out", default=None, help="head file to write (default: ./<kind>-head.safetensors)")
    p.add_argument("--prompts", default=None, help='JSONL of {"category", "prompt"} (default: the shipped set)')
    p.add_argument("--max-prompts", type=int, default=None, help="train on at most this many prompts")
    p.add_argument("--max-tokens", type=int, default=256, help="answer length per prompt (default 256)")
    p.add_argument("--answers-per-prompt", type=int, default=1,
                   help="answers recorded per prompt: the first greedy or sampled (alternating between "
                        "prompts), the second the other regime, more sampled (default 1)")
    p.add_argument("--held-out-every", type=int, default=25,
                   help="every N-th prompt is held out for evaluation (default 25)")
    p.add_argument("--eval-tokens", type=int, default=96, help="tokens per held-out answer (default 96)")
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=4,
                   help="K for the held-out acceptance (Medusa: also its number of heads; default 4)")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="draft vocabulary: the N most frequent tokens of the recorded answers (default 8192)")
    p.add_argument("--init", default=None, metavar="HEAD",
                   help="start from this head file instead of random weights, e.g. to adapt a head to "
                        "your own --prompts ('eagle' / 'medusa': the heads shipped for the embedded "
                        "model); the file gives the architecture and draft vocabulary")
    p.add_argument("--epochs", type=int, default=None, help="passes over the recorded data (default 8)")
    p.add_argument("--lr", type=float, default=None, help="peak AdamW learning rate (default 2e-3)")
    p.add_argument("--batch-tokens", type=int, default=None, help="tokens per training step (default 1024)")
    p.add_argument("--fused", action="store_true",
                   help="EAGLE only: the head reads a low, a middle and a high layer of the model, fused "
                        "(EAGLE-3), instead of the last layer alone")
    p.add_argument("--unroll", type=int, default=None,
                   help="EAGLE only: draft depths trained at once, each fed the head's own predictions "
                        "(EAGLE-3's training-time test; default 3)")
    p.add_argument("--intermediate-size", type=int, default=None,
                   help="EAGLE layer MLP width (default: the model's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", default=None, help="recordings and checkpoints (default: ~/.cache/verispec/train)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--device", default="cpu")


def _tree_shape(text: str) -> TreeShape:
    try:
        return parse_tree(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _bias_entry(text: str) -> tuple[int, float]:
    token, sep, bias = text.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not ID=BIAS (e.g. 198=-100)") from None


def print_logprobs(out: RequestOutput, tokenizer: Tokenizer) -> None:
    """One line per emitted token on stderr: the token, its log-probability, the alternatives."""

    def show(token: int) -> str:
        return repr(tokenizer.decode([token], skip_special_tokens=False))

    for record in out.logprobs or []:
        alternatives = "  ".join(f"{show(i)} {v:.3f}" for i, v in record.top)
        print(f"{show(record.token_id):>16} {record.logprob:8.3f}   {alternatives}", file=sys.stderr)


def stream_to_stdout(llm: LLM, prompt: str | list[int],
                     params: SamplingParams) -> tuple[RequestOutput | None, float]:
    """Prints a request's text as it is generated; returns (final RequestOutput or None, seconds)."""
    start = time.perf_counter()
    last = None
    for out in llm.stream(prompt, params):
        print(out.new_text, end="", flush=True)
        last = out
    return last, time.perf_counter() - start


def _started() -> None:
    """Garbage collection back on, with every live object made so far frozen (gc.freeze), once a
    command has built what it keeps for its whole run; main() turned it off when it runs as the
    `verispec` process. Through start-up Python's cycle collector would otherwise walk every object
    torch and the model made, several times while loading and once more at exit, finding nothing to
    free: ~0.3 CPU-s of a 1.7 s `verispec generate "Hi" --max-tokens 1` (docs/benchmarks.md). One
    collection of what was made since main() (~20K objects, ~10 ms) first, so that no garbage of
    the loading is frozen with the rest."""
    if not gc.isenabled():
        gc.collect(0)  # everything made while collection was off is still in the youngest generation
        gc.freeze()
        gc.enable()


def _or(value: int | None, default: int) -> int:
    """A flag's value, or its default when not given (0 is a value, and an invalid one)."""
    return default if value is None else value


def _set_threads(threads: int | None) -> None:
    import torch

    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads={threads} is invalid: expected an integer >= 1")
        torch.set_num_threads(threads)


def serve_limits(args: argparse.Namespace) -> ServeLimits:
    """The server's limits from its flags; a bad value raises ValueError naming the flag."""
    flags = {"max_request_bytes": "--max-request-bytes", "max_choices": "--max-choices",
             "header_timeout_s": "--header-timeout", "body_timeout_s": "--body-timeout",
             "max_connections": "--max-connections", "stall_s": "--stall-timeout"}
    try:
        return ServeLimits(args.max_request_bytes, args.max_choices, args.header_timeout, args.body_timeout,
                           args.max_connections, args.stall_timeout)
    except ValueError as error:
        name, _, rest = str(error).partition("=")
        raise ValueError(f"{flags.get(name, name)}={rest}") from None


def llm_kwargs(args: argparse.Namespace) -> dict:
    """LLM's arguments from the model flags (add_model_arguments), for this process or a replica."""
    kwargs = dict(model=args.model, draft=args.draft, num_speculative_tokens=args.num_speculative_tokens,
                  dtype=args.dtype, device=args.device, tree=args.tree, quantization=args.quantize,
                  quantization_group_size=args.quantize_group_size, enable_prefix_caching=args.prefix_caching,
                  kv_cache_gib=args.kv_cache_gib, enforce_eager=args.enforce_eager)
    if hasattr(args, "max_num_seqs"):
        kwargs["max_num_seqs"] = args.max_num_seqs
    return kwargs


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .engine.llm import LLM
    from .serve import build_app
    from .serve.limits import server_config

    limits = serve_limits(args)
    if args.ray_replicas is not None:
        return serve_on_ray(args, limits)
    if args.address is not None:
        raise ValueError(f"--address={args.address} needs --ray-replicas")
    _set_threads(args.threads)
    try:
        print("loading model ...", file=sys.stderr, flush=True)
        app = build_app(LLM(**llm_kwargs(args)), args.served_model_name, limits, args.web_ui)
        _started()
        uvicorn.Server(server_config(app, args.host, args.port, limits)).run()
    # uvicorn shuts down gracefully on the first Ctrl-C, then raises it again for the caller;
    # that is the way out, not an error worth a traceback.
    except KeyboardInterrupt:
        print("verispec: server stopped (Ctrl-C)", file=sys.stderr)
        return 130
    return 0


def serve_on_ray(args: argparse.Namespace, limits: ServeLimits) -> int:
    from .cluster import ray_session
    from .serve.on_ray import check_replicas, deploy

    _started()  # the replicas load the model, each in its own process
    threads = 1 if args.threads is None else args.threads
    check_replicas(args.ray_replicas, threads)
    with ray_session(args.address):
        url = deploy(llm_kwargs(args), args.served_model_name, limits, args.ray_replicas, threads,
                     args.host, args.port, args.web_ui)
        print(f"serving on {url} with {args.ray_replicas} Ray Serve replicas; Ctrl-C stops", file=sys.stderr,
              flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
        finally:
            from ray import serve as ray_serve

            ray_serve.shutdown()
    return 0


def run_batch(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from .batch.run import local_backend, run_batch as run

    kwargs = llm_kwargs(args)
    if args.ray:
        from .batch.on_ray import ray_backend

        if args.threads is not None:
            raise ValueError(f"--threads={args.threads} is for this process: with --ray, use --threads-per-replica")

        def backend():  # type: ignore[no-untyped-def]
            return ray_backend(args.address, kwargs, args.served_model_name, _or(args.replicas, 1),
                               _or(args.threads_per_replica, 1), _or(args.batch_size, 64))
    else:
        for flag in ("address", "replicas", "threads_per_replica", "batch_size"):
            if getattr(args, flag) is not None:
                raise ValueError(f"--{flag.replace('_', '-')}={getattr(args, flag)} needs --ray")

        def backend():  # type: ignore[no-untyped-def]
            from .engine.llm import LLM

            _set_threads(args.threads)
            tqdm.write("loading model ...", file=sys.stderr)  # under the progress bar
            return local_backend(lambda: LLM(**kwargs), args.served_model_name, 2 * args.max_num_seqs)

    summary = run(args.input, args.output, backend, progress=args.progress)
    print(f"{summary.lines} requests: {summary.resumed} already in {args.output}, {summary.answered} answered, "
          f"{summary.failed} failed (error records) by this run", file=sys.stderr)
    return 0


def _file_text(flag: str, path: str | None) -> str | None:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{flag} {path!r} cannot be read: {error}") from None


def generate(args: argparse.Namespace) -> int:
    from .engine.llm import LLM

    _set_threads(args.threads)
    params = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        seed=args.seed, max_tokens=args.max_tokens, stop=tuple(args.stop),
        guidance_scale=args.guidance_scale, negative_prompt=args.negative_prompt,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty, logit_bias=dict(args.logit_bias) or None,
        banned_token_ids=args.ban_token, logprobs=args.logprobs,
        json_schema=_file_text("--json-schema", args.json_schema), json_object=args.json_object,
        regex=args.regex, grammar=_file_text("--grammar", args.grammar),
    )
    print("loading model ...", file=sys.stderr, flush=True)
    llm = LLM(**llm_kwargs(args))
    _started()
    prompt: str | list[int] = args.prompt
    if args.chat:
        text = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        prompt = llm.tokenizer.encode(text, add_special_tokens=False)  # the template wrote any BOS
    last, elapsed = stream_to_stdout(llm, prompt, params)
    print()
    if last is None:
        return 1
    if last.finish_reason == "error":
        print(f"verispec: generation failed: {last.error}", file=sys.stderr)
        return 1
    print_logprobs(last, llm.tokenizer)
    stats = last.stats
    tokens = len(last.token_ids)
    spec = (
        f", acceptance rate {stats.acceptance_rate:.2f}, mean acceptance length {stats.mean_acceptance_length:.2f}"
        if stats.num_draft_tokens else ", no drafts verified"
    )
    cached = f"; {last.num_cached_tokens or 0} of {len(last.prompt_token_ids)} prompt tokens cached"
    print(f"[{tokens} tokens in {elapsed:.2f} s, {tokens / elapsed:.1f} tok/s{spec}{cached}; "
          f"finish: {last.finish_reason}]", file=sys.stderr)
    return 0


# What bad input (arguments, model files, chat templates) and a machine too small for the model
# raise; anything else is a bug in verispec and keeps its traceback.
_USER_ERRORS = (ValueError, TypeError, OSError, MemoryError)


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the `verispec` process, not a caller's main(argv) (the tests): until _started()
        gc.disable()
    args = build_parser().parse_args(argv)
    import torch

    try:
        if args.command in ("train-drafter", "run-batch"):
            _started()  # hours of work, not start-up: nothing to save
        if args.command == "train-drafter":
            _set_threads(args.threads)
            from .train.command import run

            return run(args)
        if args.command == "run-batch":
            return run_batch(args)
        return serve(args) if args.command == "serve" else generate(args)
    except (*_USER_ERRORS, torch.OutOfMemoryError) as err:
        print(f"verispec: error: {str(err) or type(err).__name__}", file=sys.stderr)
        return 2

if __name__ == "__main__":
    sys.exit(main())
