"""``expertcache serve``: an OpenAI-compatible HTTP server for a local MoE checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

from .options import add_cache_options, cache_config

API_KEY_ENV = "EXPERTCACHE_API_KEY"


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description="Serve a GGUF file or a local checkpoint directory through the expert cache: "
                                   "/v1/chat/completions, /v1/completions (streamed or not), /v1/models, "
                                   "and /v1/expertcache/stats. Listens on 127.0.0.1 unless --host says "
                                   "otherwise; requests run one at a time in arrival order (docs/serve.md).")
    p.add_argument("model", metavar="MODEL", help="a GGUF file or a local checkpoint directory (as for "
                   "expertcache generate)")
    add_cache_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this "
                   "machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV} "
                   "when set)")
    p.add_argument("--model-name", help="the name clients send as 'model' (default: the directory name)")
    p.add_argument("--max-tokens", type=int, default=2048, help="most new tokens per request")
    p.add_argument("--max-prompt-tokens", type=int, help="most prompt tokens (default: the model's context)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (default 1 MiB)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting before new ones get 503")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(func=run)


def run(args) -> int:
    from ..serve.settings import ServeSettings, listen

    settings = ServeSettings(model_name=args.model_name or Path(args.model).resolve().name, host=args.host,
                             port=args.port, api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
                             max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens,
                             max_tokens=args.max_tokens, max_queue=args.max_queue, log_level=args.log_level)
    config = cache_config(args)  # bad flags fail before the model loads
    sock = listen(settings.host, settings.port)  # a busy port or a foreign host too
    try:
        try:
            from ..serve.server import Server
        except ImportError as err:  # the web stack is an optional extra
            raise ValueError(f"expertcache serve needs the 'serve' extra: pip install 'expertcache[serve]' "
                             f"({err.name or err} is missing)") from None
        from ..integrations.transformers import offload
        from ..loaders import check_cache_size, check_model_path, load_tokenizer

        check_model_path(Path(args.model))
        check_cache_size(Path(args.model), config)
        tokenizer = load_tokenizer(args.model)
        model = offload(args.model, config=config).eval()
        print(f"expertcache serve: {model.expertcache!r}")
        from ..runtime.generate import planner_line, slots_note
        cache = model.expertcache.summary()
        print(f"expertcache serve: planner {planner_line(cache)}")
        if slots_note(cache):
            print(f"expertcache serve: {slots_note(cache)}")
        Server(model, tokenizer, settings).run(sock)
    finally:
        sock.close()
    return 0
