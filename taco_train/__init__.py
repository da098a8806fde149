"""taco-train: the bundled training application of taco-jax.

`python -m taco_train --config configs/default.toml` (or the console script `taco-train`) trains
a `models` transformer on the bundled corpus with every tensor-parallel collective compressed by
`taco_jax`. The pieces: `config` (typed run configuration), `data` (corpus, tokenizer, batches),
`steps` (train state and jitted steps), `optim`, `checkpointing`, `metrics`, and `trainer`
(`train_and_evaluate`, the whole run). See docs/training.md.

Needs the `train` extra (`pip install "taco-jax[train]"`): flax, optax, orbax-checkpoint,
tokenizers, matplotlib, tqdm and tensorboardX, none of which the `taco_jax` library itself
imports; without them `python -m taco_train` says so in one line.
"""
