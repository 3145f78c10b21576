"""`python -m sparserl_mcore` is the `sparserl` console script."""

import sys

from sparserl_mcore.cli import main

sys.exit(main())
