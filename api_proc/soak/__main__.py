import sys

from api_proc.soak import main

sys.exit(main(prog="python -m api_proc.soak"))
