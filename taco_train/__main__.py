"""`python -m taco_train [--config FILE] [--set SECTION.KEY=VALUE ...]`: see `taco_train.main`."""

from taco_train.main import main

main()
