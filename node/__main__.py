"""``python -m node``: the same as the ``swarm-node`` command."""

from node.cli import main

raise SystemExit(main())
