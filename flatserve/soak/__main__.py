import sys

from flatserve.soak import main

sys.exit(main(prog="python -m flatserve.soak"))
