import sys

from api_proc.bench import main

sys.exit(main(prog="python -m api_proc.bench"))
