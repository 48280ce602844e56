"""`python -m scalelab.cli ...`: the `scalelab` command without its console script."""
import sys

from . import main

sys.exit(main())
