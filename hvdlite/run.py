"""``python -m hvdlite.run`` is ``hvdliterun``."""
import sys

from hvdlite.runner.launch import main

if __name__ == "__main__":
    sys.exit(main())
