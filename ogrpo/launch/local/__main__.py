"""`python -m ogrpo.launch.local run JOB_DIR`: the background run `start_detached` starts (the same command since
the local.py module became this package)."""

import sys

from ogrpo.launch.local import _main

if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
