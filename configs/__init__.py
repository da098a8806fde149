"""The bundled training configs (TOML), installed as `taco_train.configs` (pyproject.toml), so
that an installed trainer finds them by name (`--config default`)."""
