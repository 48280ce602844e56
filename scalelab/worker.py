"""`python -m scalelab.worker`: an alias of `python -m scalelab.train.worker`, kept for batch scripts written by
earlier versions and for commands in course notes; new code starts scalelab.train.worker."""
import sys

from .train.worker import main

if __name__ == "__main__":
    sys.exit(main())
