"""``python -m server``: the same command as ``lookahead-server``."""

from server.cli import main

raise SystemExit(main())
