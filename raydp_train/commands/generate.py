"""`raydp-train generate RUN_DIR --prompt TEXT`: sampled continuations from a causal LM run's
saved model (`RUN_DIR/model`, loaded by transformers alone). Generating from a released
model is post-processing: it spends no privacy."""

from __future__ import annotations

import argparse
from pathlib import Path

from raydp_train.errors import UserError


class GenerateError(UserError, ValueError):
    """The run directory holds no causal LM to sample from."""


def add_generate_command(commands, parents: list) -> None:
    summary = "print sampled continuations of a prompt from a causal LM run's saved model"
    command = commands.add_parser("generate", help=summary, description=summary, parents=parents)
    command.add_argument("run_dir", metavar="RUN_DIR")
    command.add_argument("--prompt", required=True, help="the text to continue")
    command.add_argument("--samples", type=int, default=3, metavar="N",
                         help="continuations to print (default 3)")
    command.add_argument("--max-new-tokens", type=int, default=30, metavar="N",
                         help="tokens sampled per continuation (default 30)")
    command.add_argument("--seed", type=int, default=None, help="reproducible samples")
    command.set_defaults(command=generate_command)


def generate_command(args: argparse.Namespace) -> int:
    for text in continuations(Path(args.run_dir), args.prompt, args.samples,
                              args.max_new_tokens, args.seed):
        print(text)
    return 0


def continuations(run_dir: Path, prompt: str, samples: int, max_new_tokens: int,
                  seed: int | None = None) -> list[str]:
    """`samples` texts: the prompt and a sampled continuation of it each."""
    import torch

    model, tokenizer = _load(run_dir / "model")
    if seed is not None:
        torch.manual_seed(seed)
    ids = torch.tensor([prompt_ids(tokenizer, prompt)])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                             max_new_tokens=max_new_tokens, num_return_sequences=samples,
                             pad_token_id=pad)
    return [tokenizer.decode(row, skip_special_tokens=True) for row in out]


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt as training saw a text's start: its special start token kept, the end token
    a tokenizer appends (BERT's [SEP]) dropped, so the model continues the text."""
    ids = tokenizer(prompt)["input_ids"]
    ends = {tokenizer.sep_token_id, tokenizer.eos_token_id} - {None}
    return ids[:-1] if len(ids) > 1 and ids[-1] in ends else ids


def _load(folder: Path):
    import transformers

    if not (folder / "config.json").is_file():
        raise GenerateError(f"no saved model at {folder}: generate needs the run directory of "
                            "a model.task causal_lm run")
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as error:
        raise GenerateError(f"cannot load a causal LM and its tokenizer from {folder}: "
                            f"{error}") from error
    return model.eval(), tokenizer
