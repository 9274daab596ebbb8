"""``python -m node``: the same as the ``swarm-node`` command."""

from node.ops import main

raise SystemExit(main())
