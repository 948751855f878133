"""``python -m bench``: the benchmark's command line (``bench.cli.main``)."""

import sys

from bench.cli import main

sys.exit(main())
