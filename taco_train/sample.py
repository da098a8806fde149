"""Text from a trained model: `python -m taco_train.sample RUN_DIR|HF_DIR --prompt "..."`.

RUN_DIR is a run's out_dir: the parameters of its newest good checkpoint (read as the export
reads them, whatever layout trained it) and the run's tokenizer.json. HF_DIR is a Hugging Face
directory (`taco_models.hf`: GPT-2, Qwen2, Llama, Mistral; an export) with its tokenizer.json.
Decoding is `taco_models.generate` (a key / value cache) on JAX's default device, CPU or GPU: greedy
by default, or drawn with `--temperature` and `--top-k` from `--seed`; at most
`--max-new-tokens` tokens, fewer where the end-of-text token comes first. Prints the prompt and
its continuation; an empty prompt starts after an end-of-text token (a new document)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path


def load(source: str | Path):
    """(ModelConfig, fp32 parameters, `tokenizers.Tokenizer`, end-of-text ids) of a run
    directory or a Hugging Face directory. The ids end a text (any of them) and the first starts
    an empty prompt: a run's are those its export writes (`taco_train.export.run_tokenizer`),
    so that the run directory and its export continue a prompt alike."""
    from tokenizers import Tokenizer

    from taco_models import hf
    from taco_train.config import ConfigError
    from taco_train.export import restore_params, run_tokenizer

    source = Path(source)
    tokenizer_file = source / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ConfigError(
            f"{tokenizer_file}: no such file (a run writes it when it starts; a "
            "Hugging Face directory holds its tokenizer there)"
        )
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    if (source / "checkpoints").is_dir():  # a run directory
        cfg, params, _ = restore_params(source)
        return cfg.model, params, tokenizer, run_tokenizer(source, cfg).eos_ids
    try:
        model, params = hf.load(source)
    except hf.CheckpointError as error:
        if (source / hf.CONFIG_FILE).is_file():  # a Hugging Face directory, damaged
            raise ConfigError(str(error)) from None
        raise ConfigError(
            f"{source} is neither a run directory (no checkpoints/) nor a Hugging "
            f"Face directory: {error}"
        ) from None
    return model, params, tokenizer, _hf_end_of_text(source, tokenizer)


def _hf_end_of_text(directory: Path, tokenizer) -> tuple[int, ...]:
    """generation_config.json's eos_token_id (else config.json's), else "<|endoftext|>"'s id,
    else none."""
    from taco_train.data import EOT
    from taco_train.export import generation_ids

    eos = generation_ids(directory).get("eos")
    if eos and all(isinstance(i, int) for i in eos):
        return tuple(eos)
    eot = tokenizer.token_to_id(EOT)
    return () if eot is None else (eot,)


def complete(
    model, params, tokenizer, eos: Sequence[int], prompt: str, max_new_tokens: int, **sampling
) -> str:
    """The continuation of `prompt` (text, up to the first of the end-of-text ids `eos`),
    decoded by `taco_models.generate.generate` with `sampling` (temperature, top_k, seed,
    dtype); an empty prompt starts after `eos[0]`."""
    import numpy as np

    from taco_models.generate import generate

    ids = tokenizer.encode(prompt).ids
    if not ids:
        if not eos:
            raise ValueError(
                "the prompt is empty and the tokenizer has no end-of-text token to "
                "start from: give --prompt"
            )
        ids = [eos[0]]
    new = np.asarray(generate(model, params, np.asarray([ids]), max_new_tokens, **sampling))[0]
    ends = np.flatnonzero(np.isin(new, list(eos)))
    return tokenizer.decode(new[: ends[0]].tolist() if len(ends) else new.tolist())


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="taco_train.sample", description=__doc__.splitlines()[0])
    parser.add_argument("source", help="a run's directory (run.out_dir) or a Hugging Face one")
    parser.add_argument("--prompt", default="", help="the text to continue (default: none)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="token budget (64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    parser.add_argument("--top-k", type=int, default=None, help="draw among the k likeliest")
    parser.add_argument("--seed", type=int, default=0, help="seed of the draws (0)")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="compute dtype (float32)",
    )
    args = parser.parse_args(argv)
    from taco_train.config import ConfigError

    try:
        model, params, tokenizer, eos = load(args.source)
        text = complete(
            model,
            params,
            tokenizer,
            eos,
            args.prompt,
            args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            seed=args.seed,
            dtype=args.dtype,
        )
    except (ConfigError, ValueError) as error:
        print(f"taco-train sample: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    print(args.prompt + text)


if __name__ == "__main__":
    main()
