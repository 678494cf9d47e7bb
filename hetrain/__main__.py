"""`python -m hetrain VERB ...`: the same as the `hetrain` command, for where that script is not on PATH."""

import sys

from hetrain.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
