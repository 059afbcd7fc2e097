import sys

from flatserve.bench import main

sys.exit(main(prog="python -m flatserve.bench"))
