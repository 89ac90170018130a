"""`python -m fusegen.engine.parallel RANK`: one rank of a device group (worker.py)."""
import sys

from fusegen.engine.parallel.tesseract_layers import GridShardRunner
from fusegen.engine.parallel.worker import main

main(int(sys.argv[1]), GridShardRunner)
