"""``expertcache generate``: run a local MoE checkpoint through the expert cache."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .options import add_cache_options, add_sampling_options, cache_config, sampling
from .paths import check_output


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text with the expert cache and report speed and hits",
                       description="Generation from a GGUF file or a local checkpoint directory with "
                                   "experts in host memory behind a device slot pool. Tokens print as "
                                   "they are produced; "
                                   "then prefill and decode tok/s (cold: first 16 tokens, warm: to N/4, "
                                   "steady: the rest) with hit rate and H2D bytes per token, and the "
                                   "slot pool size. Greedy unless --temperature is above 0.")
    p.add_argument("model", metavar="MODEL", help="a GGUF file (model.gguf, or the first part of a split "
                   "one; experts stay quantized) or a local checkpoint directory (save_pretrained layout)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="file holding the prompt")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the model's "
                   "chat template")
    add_cache_options(p)
    add_sampling_options(p, temperature=0.0)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--json", metavar="OUT", help="also save the summary as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    prompt = args.prompt if args.prompt is not None else _read(args.prompt_file)
    config, how = cache_config(args), sampling(args)  # bad flags fail before torch is imported
    check_output(args.json, "--json")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")

    from ..integrations.transformers import offload
    from ..loaders import check_cache_size, check_model_path, load_tokenizer, model_context
    from ..runtime.generate import ContextError, check_context, encode, format_summary, generate_and_measure

    check_model_path(Path(args.model))
    check_cache_size(Path(args.model), config)
    tokenizer = load_tokenizer(args.model)
    try:  # the rule serve applies to max_tokens, checked before the model loads
        check_context(len(encode(tokenizer, prompt, args.chat)), args.max_new_tokens,
                      model_context(Path(args.model)))
    except ContextError as err:
        raise ValueError(f"{err} (--max-new-tokens)") from None
    model = offload(args.model, config=config).eval()
    _, summary = generate_and_measure(model, tokenizer, prompt, args.max_new_tokens, how, chat=args.chat,
                                      on_text=_print_now)
    print("\n")
    print(format_summary(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


def _print_now(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _read(path: str) -> str:
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"prompt file not found: {file}")
    return file.read_text()
